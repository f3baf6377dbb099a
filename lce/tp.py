"""Vocab-parallel tensor parallelism: the slice of the vocabulary a rank owns, and the collectives.

Forward: one MAX all-reduce of the per-token max, then one packed SUM of the shards' sums.
Backward: grad_hidden is the SUM over ranks (fp32), unless the caller reduce-scatters it itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lce.backends.base import ShardStats


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of the LM head: global ids ``[vocab_start, vocab_start + vocab_local)``."""

    group: dist.ProcessGroup | None
    vocab_start: int
    vocab_local: int

    def owns(self, targets: torch.Tensor) -> torch.Tensor:
        """bool per target: its global id lies in this shard."""
        local = targets - self.vocab_start
        return (local >= 0) & (local < self.vocab_local)


def resolve_shard(
    tp_group: dist.ProcessGroup | None,
    vocab_start: int | None,
    vocab_local: int,
    device: torch.device,
) -> VocabShard:
    """Shard of the calling rank; ``vocab_start`` defaults to ``tp_rank * vocab_local``."""
    if tp_group is not None and not dist.is_initialized():
        raise ValueError("tp_group was given but torch.distributed is not initialized")
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    if vocab_start is None:
        if tp_group is not None:
            _require_equal_shards(tp_group, vocab_local, device)
        vocab_start = 0 if tp_group is None else dist.get_rank(tp_group) * vocab_local
    return VocabShard(tp_group, int(vocab_start), vocab_local)


@dataclass(frozen=True)
class GlobalStats:
    """Per-token fp32 ``[T]`` softmax statistics over the whole vocabulary.

    Every field is relative to the row max m, so nothing is rounded at the logits' magnitude, and
    ``1 - p_y`` is a ratio of two sums rather than a difference that cancels on confident rows.
    """

    max: torch.Tensor  # m, the row max over all shards
    log_sumexp: torch.Tensor  # log sum_j exp(z_j - m): lse = m + log_sumexp, never rounded whole
    target_logit: torch.Tensor
    centred_mean: torch.Tensor  # E_p[z] - m
    target_complement: torch.Tensor  # 1 - p_y = sum_{j != y} exp(z_j - m) / sum_j exp(z_j - m)
    owners: torch.Tensor  # how many shards hold the target id: 1 if valid, 0 if outside [0, V)

    @property
    def entropy(self) -> torch.Tensor:
        """``lse - E_p[z]``, both centred on m."""
        return self.log_sumexp - self.centred_mean

    @property
    def logprob(self) -> torch.Tensor:
        """``z_y - lse``: ``log1p(-(1 - p_y))`` while p_y > 1/2 (exact for confident rows, where
        ``(z_y - m) - log_sumexp`` carries log_sumexp's rounding), that difference otherwise."""
        confident = self.target_complement < 0.5
        return torch.where(
            confident,
            torch.log1p(-self.target_complement),
            (self.target_logit - self.max) - self.log_sumexp,
        )

    def target_grad(self, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor) -> torch.Tensor:
        """``d_z`` on the target lane, ``g_lp (1 - p_y) - g_ent p_y (z_y - E[z])``, uncancelled."""
        p_target = torch.exp(self.logprob)
        spread = (self.target_logit - self.max) - self.centred_mean
        return grad_logprob * self.target_complement - grad_entropy * p_target * spread


def _require_equal_shards(group: dist.ProcessGroup, vocab_local: int, device: torch.device) -> None:
    """The default ``vocab_start = rank * V_local`` is only right when all shards have one size."""
    sizes = torch.tensor([vocab_local, -vocab_local], dtype=torch.float32, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    if sizes[0] != -sizes[1]:
        raise ValueError(
            f"vocab shards of the TP group have different sizes ({int(-sizes[1])}..{int(sizes[0])} "
            "rows), so the default vocab_start = tp_rank * V_local is wrong; pass vocab_start "
            "(this rank's first global id) explicitly"
        )


def merge_stats(
    stats: ShardStats, target_owned: torch.Tensor, group: dist.ProcessGroup | None
) -> GlobalStats:
    """Combine each rank's shard stats: one MAX all-reduce, then one packed SUM all-reduce.

    ``target_owned`` is a bool ``[T]``: this rank's shard holds the token's target id.
    """
    global_max = stats.max.clone()
    if group is not None:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    # A rank whose shard is empty (or whose row is all -inf) has max = -inf: it must add exactly 0.
    owned = torch.isfinite(stats.max)
    shift = torch.where(owned, stats.max - global_max, torch.zeros_like(global_max))
    scale = torch.where(owned, torch.exp(shift), torch.zeros_like(shift))
    # Re-centre sum exp(z - m_r) (z - m_r) on the global max M: add (m_r - M) * sumexp.
    sumexp_z = scale * (stats.sumexp_z + shift * stats.sumexp)
    packed = torch.stack(
        [
            stats.sumexp * scale,
            sumexp_z,
            stats.sumexp_others * scale,
            stats.target_logit,
            target_owned.to(sumexp_z.dtype),
        ]
    )
    if group is not None:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    sumexp, sumexp_z, sumexp_others, target_logit, owners = packed.unbind(0)
    return GlobalStats(
        max=global_max,
        log_sumexp=torch.log(sumexp),
        target_logit=target_logit,
        centred_mean=sumexp_z / sumexp,
        target_complement=sumexp_others / sumexp,
        owners=owners,
    )


def reduce_grad_hidden(grad_hidden: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum the per-rank partial ``grad_hidden`` (fp32) over the TP group, in place."""
    if group is not None:
        dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=group)
    return grad_hidden
