"""Opt-in megatron-core integration: the LM head's vocab projection and cross-entropy (or per-token
log-probs and entropy) computed by lce, without materializing logits and without editing
megatron-core.

A trainer turns it on for one model::

    from lce.megatron import FusedOutputOptions, patch_gpt_model

    patch_gpt_model(model)                       # SFT: model(..., labels=l) -> loss [B, S]
    patch_gpt_model(model, returns="logprobs",   # RL: -> TokenOutputs(logprobs, entropy) [B, S]
                    options=FusedOutputOptions(temperature=0.7))

or calls the functions on its own decoder output (``hidden`` ``[S, B, H]``, labels ``[B, S]``)::

    out = output_layer_logprobs(hidden, model.output_layer, labels,
                                weight=model.shared_embedding_or_output_weight())

The TP group and vocab range are the output layer's own (its process-group collection, else
megatron-core's parallel state; ``VocabUtility`` ranges); the weight is the one the model passes
(the shared embedding weight with tied embeddings); under sequence parallelism hidden is gathered
with megatron-core's gather, whose backward reduce-scatters grad_hidden. Configurations it does not
reproduce (output-layer bias, deferred embedding wgrad, ``disable_grad_reduce``, expert layers,
multi-token prediction) run megatron-core's stock path after one `LCEFallbackWarning`.
"""

try:
    import megatron.core  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "lce.megatron needs megatron-core: pip install 'lce[megatron]' (megatron-core>=0.16)"
    ) from error

from lce.megatron.fused import (
    FusedOutputOptions,
    LCEFallbackWarning,
    output_layer_logprobs,
    output_layer_loss,
)
from lce.megatron.patch import FusedOutputPatch, patch_gpt_model

__all__ = [
    "FusedOutputOptions",
    "FusedOutputPatch",
    "LCEFallbackWarning",
    "output_layer_logprobs",
    "output_layer_loss",
    "patch_gpt_model",
]
