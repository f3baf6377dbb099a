"""Fused log-probs, entropy and loss of a megatron-core output layer, with the stock fallback."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from lce.api import TokenOutputs, linear_cross_entropy, token_logprobs
from lce.megatron.head import check_output_layer, resolve_head, tp_group_of, unsupported_reason
from lce.megatron.stock import mapped_logits, stock_logits, stock_token_outputs
from lce.options import LogitOptions


class LCEFallbackWarning(UserWarning):
    """The fused path does not support a configuration and megatron-core's stock path ran."""


@dataclass(frozen=True)
class FusedOutputOptions:
    """How to compute; the fields mean what they mean in `lce.token_logprobs`.

    ``logit_scale`` and ``softcap`` are the logit map of a model whose trainer applies them
    (megatron-core 0.16's GPTModel applies neither): both paths apply them, the fused one and the
    stock fallback, so a fallback never computes other logits than asked.
    """

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None
    ignore_index: int = -100
    backend: str = "auto"
    chunk_size: int | None = None
    # Bytes of logits the per-token path may keep for its backward (3 GEMMs where they fit);
    # the main_grad path takes 3 GEMMs already and keeps none.
    keep_logits_bytes: int = 0
    # The gradient the trainer's loss puts on each token's loss, which the main_grad path (see
    # `output_layer_loss`) assumes: 1.0 with calculate_per_token_loss and no loss scaling; else
    # the loss scale / (tokens x micro-batches). Any other upstream stays exact, at a recompute.
    assumed_loss_grad: float = 1.0

    def __post_init__(self) -> None:
        self.logit()  # the values checked as lce checks them, naming the argument

    def logit(self) -> LogitOptions:
        """The logit map these options ask for."""
        return LogitOptions(
            temperature=self.temperature, logit_scale=self.logit_scale, softcap=self.softcap
        )


_WARNED: set[str] = set()


def warn_fallback(reason: str) -> None:
    """Warn once per process and reason that the stock path runs instead of the fused one."""
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(
        f"lce.megatron: {reason} is not supported by the fused path; using megatron-core's stock "
        "output layer and vocab-parallel cross-entropy (materialized logits) instead",
        LCEFallbackWarning,
        stacklevel=3,
    )


def output_layer_logprobs(
    hidden: torch.Tensor,
    output_layer: torch.nn.Module,
    labels: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    options: FusedOutputOptions | None = None,
) -> TokenOutputs:
    """Per-token fp32 ``(logprobs, entropy)`` ``[B, S]`` of ``output_layer(hidden, weight)``.

    Args:
        hidden: the decoder's output ``[S, B, H]`` as the output layer receives it (this rank's
            ``[S / tp, B, H]`` slice under sequence parallelism); cast to the weight's dtype for
            the matmul, its gradient comes back in its own dtype.
        output_layer: the model's ``ColumnParallelLinear`` LM head.
        labels: global token ids ``[B, S]`` (megatron's layout); ``ignore_index`` gives 0.
        weight: what the model passes as ``output_layer(hidden, weight=...)``: the shared
            embedding weight with tied embeddings; None for the layer's own weight.
    Gradients flow to ``hidden`` and the weight as in the stock path (grad_hidden summed over
    TP, reduce-scattered under sequence parallelism). Unsupported layers (see
    `lce.megatron.head.unsupported_reason`) run the stock path after one `LCEFallbackWarning`.
    """
    return _outputs(hidden, output_layer, labels, weight, options or FusedOutputOptions(), True)


def output_layer_loss(
    hidden: torch.Tensor,
    output_layer: torch.nn.Module,
    labels: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    options: FusedOutputOptions | None = None,
) -> torch.Tensor:
    """Per-token fp32 cross-entropy ``[B, S]``, what ``GPTModel.compute_language_model_loss``
    returns (apply the loss mask and reduce as usual). Arguments as `output_layer_logprobs`.

    With ``gradient_accumulation_fusion`` (the layer's flag) and an fp32 ``weight.main_grad``
    (Megatron's DDP), the loss takes the 3-GEMM path that adds the weight gradient straight into
    main_grad and returns what megatron-core's own layers return for the weight (see
    `lce.grad_buffer.into_forward`); its forward assumes each token's loss gets
    ``options.assumed_loss_grad`` (tokens whose upstream differs, e.g. loss-masked ones, are
    recomputed in backward). Otherwise the weight gets an ordinary ``.grad``.
    """
    options = options or FusedOutputOptions()
    return -_outputs(hidden, output_layer, labels, weight, options, False).logprobs


def _outputs(
    hidden: torch.Tensor,
    output_layer: torch.nn.Module,
    labels: torch.Tensor,
    weight: torch.Tensor | None,
    options: FusedOutputOptions,
    with_entropy: bool,
) -> TokenOutputs:
    if hidden.dim() != 3 or labels.dim() != 2:
        raise ValueError(
            f"hidden must be [S, B, H] and labels [B, S] (megatron's layouts), got hidden "
            f"{tuple(hidden.shape)} and labels {tuple(labels.shape)}"
        )
    check_output_layer(output_layer)
    targets = labels.transpose(0, 1)
    reason = unsupported_reason(output_layer)
    if reason is not None:
        warn_fallback(reason)
        logits = mapped_logits(stock_logits(hidden, output_layer, weight, 1.0), options.logit())
        _check_sequence(logits, targets)
        out = stock_token_outputs(
            logits, targets, tp_group_of(output_layer), options.ignore_index, with_entropy
        )
    else:
        out = _fused(hidden, output_layer, targets, weight, options, with_entropy)
    return TokenOutputs(*(None if t is None else t.transpose(0, 1).contiguous() for t in out))


def fused_main_grad(output_layer: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor | None:
    """The fp32 ``weight.main_grad`` the stock layer would accumulate into, or None.

    As ColumnParallelLinear: only with the layer's ``gradient_accumulation_fusion`` and a weight
    that has ``main_grad`` (set by Megatron's DDP). A low-precision main_grad, or a frozen weight,
    takes the ordinary ``.grad`` path, which Megatron's DDP hook adds to main_grad.
    """
    if not getattr(output_layer, "gradient_accumulation_fusion", False):
        return None
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None or main_grad.dtype != torch.float32 or not weight.requires_grad:
        return None
    return main_grad


def _fused(
    hidden: torch.Tensor,
    output_layer: torch.nn.Module,
    targets: torch.Tensor,
    weight: torch.Tensor | None,
    options: FusedOutputOptions,
    with_entropy: bool,
) -> TokenOutputs:
    head = resolve_head(output_layer, weight)
    if head.sequence_parallel:
        # Backward reduce-scatters the (partial) grad_hidden: lce must not all-reduce it too.
        hidden = gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=True, group=head.tp_group
        )
    _check_sequence(hidden, targets)
    common = dict(
        ignore_index=options.ignore_index, temperature=options.temperature,
        logit_scale=options.logit_scale, softcap=options.softcap, tp_group=head.tp_group,
        vocab_start=head.vocab_start, reduce_grad_hidden=not head.sequence_parallel,
        backend=options.backend, chunk_size=options.chunk_size,
        keep_logits_bytes=options.keep_logits_bytes,
    )  # fmt: skip
    main_grad = None if with_entropy else fused_main_grad(output_layer, head.weight)
    if main_grad is not None:
        losses = linear_cross_entropy(
            hidden, head.weight, targets, reduction="none", grad_weight_into=main_grad,
            assumed_loss_grad=options.assumed_loss_grad, **common,
        )  # fmt: skip
        return TokenOutputs(-losses, None)
    return token_logprobs(hidden, head.weight, targets, **common)


def _check_sequence(full: torch.Tensor, targets: torch.Tensor) -> None:
    if tuple(full.shape[:2]) != tuple(targets.shape):
        raise ValueError(
            f"labels [B, S] = {tuple(targets.shape[::-1])} do not match the (gathered) hidden "
            f"states [S, B, H] = {tuple(full.shape)}; under sequence parallelism pass this "
            "rank's hidden slice and the full-sequence labels"
        )
