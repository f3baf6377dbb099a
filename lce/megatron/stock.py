"""megatron-core's stock path, used as the fallback: materialized vocab-parallel logits from the
output layer itself, then ``vocab_parallel_cross_entropy`` (and a vocab-parallel entropy)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import (
    reduce_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)

from lce.api import TokenOutputs
from lce.options import LogitOptions
from lce.validation import check_target_ids


def stock_logits(
    hidden: torch.Tensor,
    output_layer: torch.nn.Module,
    weight: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """fp32 ``[S, B, V_local]`` logits / temperature, exactly as the layer computes them (bias,
    sequence-parallel gather and all); the vocab stays sharded."""
    logits, _ = output_layer(hidden, weight=weight, runtime_gather_output=False)
    return logits.float() / temperature


def mapped_logits(layer_logits: torch.Tensor, logit: LogitOptions) -> torch.Tensor:
    """``logit``'s map on the layer's fp32 logits ``a`` (its bias included):
    ``cap * tanh(s * a / cap) / T``, as lce applies it."""
    logits = layer_logits * logit.logit_scale
    if logit.softcap is not None:
        logits = logit.softcap * torch.tanh(logits / logit.softcap)
    return logits / logit.temperature


def stock_token_outputs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    ignore_index: int,
    with_entropy: bool,
) -> TokenOutputs:
    """Per-token ``(logprobs, entropy)`` ``[S, B]`` from vocab-parallel fp32 ``logits``.

    ``targets`` ``[S, B]`` are global ids; ignored tokens give exactly 0. ``entropy`` is None
    unless ``with_entropy``. Out-of-vocabulary targets raise like the fused path.
    """
    ignored = targets == ignore_index
    vocab = logits.shape[-1] * (1 if tp_group is None else dist.get_world_size(tp_group))
    check_target_ids(targets, ignored | ((targets >= 0) & (targets < vocab)), ignore_index)
    safe = torch.where(ignored, torch.zeros_like(targets), targets).contiguous()
    # vocab_parallel_cross_entropy subtracts the max from its input in place: give it a copy.
    loss = vocab_parallel_cross_entropy(logits.clone(), safe)
    zero = torch.zeros_like(loss)
    logprobs = torch.where(ignored, zero, -loss)
    entropy = None
    if with_entropy:
        entropy = torch.where(ignored, zero, _vocab_parallel_entropy(logits, tp_group))
    return TokenOutputs(logprobs, entropy)


def _vocab_parallel_entropy(
    logits: torch.Tensor, tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``lse - sum_j p_j z_j`` over the whole vocabulary from this rank's ``[..., V_local]``.

    Sums cross ranks with megatron's reduce (all-reduce forward, identity backward), the same
    convention as its cross-entropy: every rank holds the same replicated per-token result.
    """
    local_max = logits.detach().amax(dim=-1, keepdim=True)
    if tp_group is not None:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - local_max
    exp = shifted.exp()
    sums = torch.stack([exp.sum(dim=-1), (exp * shifted).sum(dim=-1)])
    if tp_group is not None:
        sums = reduce_from_tensor_model_parallel_region(sums, group=tp_group)
    sumexp, sumexp_z = sums.unbind(0)
    return torch.log(sumexp) - sumexp_z / sumexp
