"""One pass of the 3-GEMM loss: per logits chunk, shard statistics, the TP merge and the gradients.

Shared by the fast scalar loss (`lce.autograd.fast_forward`) and the loss whose weight gradient
goes into a caller's buffer (`lce.grad_buffer`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from lce.backends.base import (
    BackwardRows,
    Grads,
    ShardStats,
    StageBackend,
    Wanted,
    accumulation_dtype,
    select_rows,
)
from lce.loss_terms import loss_upstream, token_loss
from lce.options import LogitOptions
from lce.tp import VocabShard, merge_stats


class LossPass(NamedTuple):
    """Per token, fp32 ``[T]``: the loss (`lce.loss_terms.token_loss`, not yet masked: the
    caller zeroes ignored rows), its z term (0 without z-loss) and ``owners`` (see
    `lce.tp.GlobalStats`); the fp32 gradients (grad_hidden this shard's partial sum)."""

    losses: torch.Tensor
    z_terms: torch.Tensor
    owners: torch.Tensor
    grads: Grads


def loss_pass(
    stages: StageBackend,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernel_targets: torch.Tensor,
    shard: VocabShard,
    logit: LogitOptions,
    grad_loss: torch.Tensor,
    wanted: Wanted,
    grad_weight_out: torch.Tensor | None = None,
) -> LossPass:
    """The per-token loss and the gradients of ``sum(grad_loss * loss)``, each logit computed once.

    ``hidden`` is already in weight's dtype; ``kernel_targets`` int64 with ignored rows at -1 (and
    ``grad_loss`` 0 there). ``grad_weight_out`` (fp32 ``[V_local, H]``) receives the weight
    gradient added to its content. Every TP rank must call with the same rows.
    """
    acc = accumulation_dtype(weight.dtype)
    per_token = torch.zeros(3, kernel_targets.shape[0], dtype=acc, device=kernel_targets.device)
    losses, z_terms, owners = per_token.unbind(0)

    def merge(stats: ShardStats, rows: slice) -> BackwardRows:
        owned = shard.owns(kernel_targets[rows])  # here, behind the chunk's logits GEMM
        merged = merge_stats(select_rows(stats, rows), owned, shard, logit)
        loss, z_term = token_loss(merged.logprob, merged.lse, merged.smooth, logit)
        losses[rows] = loss
        if z_term is not None:
            z_terms[rows] = z_term
        owners[rows] = merged.owners
        return merged.backward_rows(loss_upstream(grad_loss[rows].to(acc), merged.lse, logit))

    chunk_rows = _common_chunk_rows(stages, hidden, weight, shard)
    _, grads = stages.loss_grads_in_forward(
        hidden, weight, bias, kernel_targets, shard.vocab_start, logit, merge, wanted,
        grad_weight_out, chunk_rows,
    )  # fmt: skip
    return LossPass(losses, z_terms, owners, grads)


def _common_chunk_rows(
    stages: StageBackend, hidden: torch.Tensor, weight: torch.Tensor, shard: VocabShard
) -> int:
    """The backend's tokens per chunk, the smallest over the TP group: every chunk merges its
    rows over the group, so all ranks must cut the same chunks whatever their shard's size."""
    (num_tokens, hidden_size), vocab_local = hidden.shape, weight.shape[0]
    rows = stages.loss_chunk_rows(num_tokens, vocab_local, hidden_size, weight.element_size())
    if shard.group is None:
        return rows
    agreed = torch.tensor([rows], dtype=torch.int64, device=hidden.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=shard.group)
    return int(agreed.item())
