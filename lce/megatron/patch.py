"""Opt-in patch of one megatron-core ``GPTModel`` instance: with ``labels``, its forward computes
the loss (or per-token log-probs and entropy) with lce instead of logits + cross-entropy."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.models.common.language_module.language_module import LanguageModule

from lce.megatron.fused import (
    FusedOutputOptions,
    output_layer_logprobs,
    output_layer_loss,
    warn_fallback,
)

RETURNS = ("loss", "logprobs")


class FusedOutputPatch:
    """Handle of `patch_gpt_model`; ``remove()`` (or leaving the ``with`` block) undoes it."""

    def __init__(self, model: torch.nn.Module, previous: Callable[..., Any] | None) -> None:
        self.model = model
        self._previous = previous

    def remove(self) -> None:
        if "_postprocess" not in self.model.__dict__:
            return
        del self.model._postprocess
        if self._previous is not None:
            self.model._postprocess = self._previous

    def __enter__(self) -> FusedOutputPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def patch_gpt_model(
    model: torch.nn.Module,
    *,
    returns: str = "loss",
    options: FusedOutputOptions | None = None,
) -> FusedOutputPatch:
    """Make ``model(..., labels=labels)`` use lce for its LM head; megatron-core is not edited.

    ``returns="loss"``: the forward returns the per-token loss ``[B, S]`` fp32, as stock.
    ``returns="logprobs"``: it returns `lce.TokenOutputs` ``(logprobs, entropy)``, each
    ``[B, S]`` fp32 (for RL losses). Without labels, in inference, or on a stage without the
    output layer the stock forward runs unchanged. ``model`` may be wrapped (DDP,
    Float16Module): the inner ``GPTModel`` is patched. Multi-token prediction and an overridden
    ``compute_language_model_loss`` fall back to the stock loss with one warning (an error with
    ``returns="logprobs"``). ``options`` carries the logit map (temperature, logit scale, softcap)
    both the fused and the fallback paths apply.
    """
    if returns not in RETURNS:
        raise ValueError(f"returns must be one of {RETURNS}, got {returns!r}")
    gpt = _unwrap(model)
    if getattr(gpt._postprocess, "_lce_patched", False):
        raise ValueError("this model is already patched; remove() the first patch")
    options = options or FusedOutputOptions()
    stock = gpt._postprocess
    signature = inspect.signature(stock)

    def postprocess(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(*args, **kwargs).arguments
        labels = arguments.get("labels")
        inference = arguments.get("inference_context") is not None and not gpt.training
        if labels is None or inference or not gpt.post_process:
            return stock(*args, **kwargs)
        reason = _unfusable_model(gpt)
        if reason is not None:
            if returns == "logprobs":
                raise ValueError(
                    f"returns='logprobs' does not support {reason}; use returns='loss' or drop it"
                )
            warn_fallback(reason)
            return stock(*args, **kwargs)
        weight = None
        if gpt.share_embeddings_and_output_weights:
            weight = gpt.shared_embedding_or_output_weight()
        run = output_layer_logprobs if returns == "logprobs" else output_layer_loss
        return run(
            arguments["hidden_states"], gpt.output_layer, labels, weight=weight, options=options
        )

    postprocess._lce_patched = True  # type: ignore[attr-defined]
    previous = gpt.__dict__.get("_postprocess")
    gpt._postprocess = postprocess
    return FusedOutputPatch(gpt, previous)


def _unfusable_model(gpt: torch.nn.Module) -> str | None:
    """What in the model's own loss step the fused path would skip, or None.

    megatron-core 0.16's ``_postprocess`` applies no logit scale or cap (and its config has none),
    but a trainer may override ``compute_language_model_loss`` to apply one (a final-logit
    softcap, as some Gemma ports do): the patch bypasses that method, so it must not run then.
    """
    if gpt.config.mtp_num_layers is not None:
        return "multi-token prediction (config.mtp_num_layers)"
    method = getattr(gpt, "compute_language_model_loss", None)
    if getattr(method, "__func__", None) is not LanguageModule.compute_language_model_loss:
        return (
            "a compute_language_model_loss override (what it applies to the logits, e.g. a "
            "softcap, is not visible to lce: pass it through FusedOutputOptions and drop the "
            "override)"
        )
    return None


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    inner = model
    while not hasattr(inner, "_postprocess") and hasattr(inner, "module"):
        inner = inner.module
    if not hasattr(inner, "_postprocess") or not hasattr(inner, "post_process"):
        raise ValueError(
            f"{type(model).__name__} is not a megatron-core GPTModel (or a wrapper of one with "
            "`.module`); for other models call lce.megatron.output_layer_loss directly"
        )
    return inner
