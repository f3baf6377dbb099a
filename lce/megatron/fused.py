"""Fused log-probs, entropy and loss of a megatron-core output layer, with the stock fallback."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from lce.api import TokenOutputs, token_logprobs
from lce.megatron.head import check_output_layer, resolve_head, tp_group_of, unsupported_reason
from lce.megatron.stock import stock_logits, stock_token_outputs


class LCEFallbackWarning(UserWarning):
    """The fused path does not support a configuration and megatron-core's stock path ran."""


@dataclass(frozen=True)
class FusedOutputOptions:
    """How to compute; the fields mean what they mean in `lce.token_logprobs`."""

    temperature: float = 1.0
    ignore_index: int = -100
    backend: str = "auto"
    chunk_size: int | None = None


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
    returns (apply the loss mask and reduce as usual). Arguments as `output_layer_logprobs`."""
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
        logits = stock_logits(hidden, output_layer, weight, options.temperature)
        _check_sequence(logits, targets)
        out = stock_token_outputs(
            logits, targets, tp_group_of(output_layer), options.ignore_index, with_entropy
        )
    else:
        out = _fused(hidden, output_layer, targets, weight, options)
    return TokenOutputs(*(None if t is None else t.transpose(0, 1).contiguous() for t in out))


def _fused(
    hidden: torch.Tensor,
    output_layer: torch.nn.Module,
    targets: torch.Tensor,
    weight: torch.Tensor | None,
    options: FusedOutputOptions,
) -> TokenOutputs:
    head = resolve_head(output_layer, weight)
    if head.sequence_parallel:
        # Backward reduce-scatters the (partial) grad_hidden: lce must not all-reduce it too.
        hidden = gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=True, group=head.tp_group
        )
    _check_sequence(hidden, targets)
    return token_logprobs(
        hidden,
        head.weight,
        targets,
        ignore_index=options.ignore_index,
        temperature=options.temperature,
        tp_group=head.tp_group,
        vocab_start=head.vocab_start,
        reduce_grad_hidden=not head.sequence_parallel,
        backend=options.backend,
        chunk_size=options.chunk_size,
    )


def _check_sequence(full: torch.Tensor, targets: torch.Tensor) -> None:
    if tuple(full.shape[:2]) != tuple(targets.shape):
        raise ValueError(
            f"labels [B, S] = {tuple(targets.shape[::-1])} do not match the (gathered) hidden "
            f"states [S, B, H] = {tuple(full.shape)}; under sequence parallelism pass this "
            "rank's hidden slice and the full-sequence labels"
        )
