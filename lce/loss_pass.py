"""One pass of the 3-GEMM loss: per logits chunk, shard statistics, the TP merge and the gradients.

Shared by the fast scalar loss (`lce.autograd.FusedScalarLoss`) and the loss whose weight gradient
goes into a caller's buffer (`lce.grad_buffer`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from lce.backends.base import ShardStats, StageBackend, accumulation_dtype, select_rows
from lce.options import LogitOptions
from lce.tp import GlobalStats, VocabShard, merge_stats


class LossPass(NamedTuple):
    """``logprobs`` and ``owners`` fp32 ``[T]`` (see `GlobalStats`); fp32 ``grad_hidden``
    ``[T, H]`` (this shard's partial sum) and ``grad_weight`` ``[V_local, H]``, or None."""

    logprobs: torch.Tensor
    owners: torch.Tensor
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None


def loss_pass(
    stages: StageBackend,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    kernel_targets: torch.Tensor,
    shard: VocabShard,
    logit: LogitOptions,
    grad_logprob: torch.Tensor,
    need_hidden: bool,
    need_weight: bool,
    grad_weight_out: torch.Tensor | None = None,
) -> LossPass:
    """Log-probs and the gradients of ``sum(grad_logprob * logprobs)``, each logit computed once.

    ``hidden`` is already in weight's dtype; ``kernel_targets`` int64 with ignored rows at -1 (and
    ``grad_logprob`` 0 there). ``grad_weight_out`` (fp32 ``[V_local, H]``) receives the weight
    gradient added to its content. Every TP rank must call with the same rows.
    """
    owned = shard.owns(kernel_targets)
    acc = accumulation_dtype(weight.dtype)
    per_token = torch.zeros(2, kernel_targets.shape[0], dtype=acc, device=kernel_targets.device)
    logprobs, owners = per_token.unbind(0)

    def merge(stats: ShardStats, rows: slice) -> GlobalStats:
        merged = merge_stats(select_rows(stats, rows), owned[rows], shard.group, logit)
        logprobs[rows] = merged.logprob
        owners[rows] = merged.owners
        return merged

    chunk_rows = _common_chunk_rows(stages, hidden, weight, shard)
    _, grad_hidden, grad_weight = stages.loss_grads_in_forward(
        hidden, weight, kernel_targets, shard.vocab_start, logit, merge, grad_logprob,
        need_hidden, need_weight, grad_weight_out, chunk_rows,
    )  # fmt: skip
    return LossPass(logprobs, owners, grad_hidden, grad_weight)


def _common_chunk_rows(
    stages: StageBackend, hidden: torch.Tensor, weight: torch.Tensor, shard: VocabShard
) -> int:
    """The backend's tokens per chunk, the smallest over the TP group: every chunk merges its
    rows over the group, so all ranks must cut the same chunks whatever their shard's size."""
    rows = stages.loss_chunk_rows(hidden.shape[0], weight.shape[0], weight.element_size())
    if shard.group is None:
        return rows
    agreed = torch.tensor([rows], dtype=torch.int64, device=hidden.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=shard.group)
    return int(agreed.item())
