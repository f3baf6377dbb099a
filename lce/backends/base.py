"""The two stages every backend implements, so one autograd function and one TP merge serve all.

A backend works on one rank's vocab shard and never materializes ``[T, V_local]`` logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

from lce.options import LogitOptions


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax math and accumulation in fp32; fp64 inputs keep fp64 (exact-invariance checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class ShardStats:
    """Per-token softmax statistics of one vocab shard, all fp32 ``[T]``.

    With the logits ``z`` of the shard's lanes in raw units ``r`` (``z_j - z_max = k (r_j - r_max)``
    with ``k`` the `LogitOptions.centred_scale`; ``r`` is the raw dot ``a = hidden @ weight.T``):
    ``max = max_j r_j`` in raw units (``-inf`` for an empty shard; all ranks share ``k``, so the
    TP MAX merge is the same in either unit) and every lane is centred before the scale,
    ``z_j - max_z = k (r_j - max)``: the max lane's is exactly 0 and no lane carries a rounding at
    the logits' magnitude. ``sumexp_nonmax = sum_j exp(z_j - max_z)``
    over every lane but one max lane (whose term is exactly 1: kept apart, ``log sumexp`` is
    ``log1p(sumexp_nonmax)`` and keeps its precision on confident rows, where ``1 + small``
    would round it to eps(1)), ``sumexp_z = sum_j exp(z_j - max_z) * (z_j - max_z)`` (centred on
    the shard max, so entropy keeps its precision under huge common offsets), ``target_logit = r_y``
    if the global target id ``y`` lies in ``[vocab_start, vocab_start + V_local)`` else 0. An
    empty shard gives max = -inf and zeros elsewhere.
    """

    max: torch.Tensor
    sumexp_nonmax: torch.Tensor
    sumexp_z: torch.Tensor
    target_logit: torch.Tensor

    @property
    def sumexp(self) -> torch.Tensor:
        """``sum_j exp(z_j - max)`` over the whole shard (0 for an empty one)."""
        return torch.where(torch.isfinite(self.max), 1.0 + self.sumexp_nonmax, 0.0)


@dataclass(frozen=True)
class BackwardRows:
    """Per-token fp32 ``[T]`` inputs of the backward stage, global over all shards.

    ``max`` is in raw units as in `ShardStats`; with ``c_j = k (r_j - max)``
    (centred exactly as the forward centred it), ``log p_j = c_j - log_sumexp`` and
    ``z_j - E[z] = c_j - centred_mean``, so nothing is rounded at the logits' magnitude. Off the
    target lane ``d_z = -p * (grad_logprob + grad_entropy * (z - E[z]))``; on it
    ``d_z = target_grad``, computed per token from the statistics without cancellation (see
    `lce.tp.GlobalStats`).
    ``grad_logprob``/``grad_entropy`` may have any stride and are zero on ignored rows.
    """

    max: torch.Tensor
    log_sumexp: torch.Tensor
    centred_mean: torch.Tensor
    grad_logprob: torch.Tensor
    grad_entropy: torch.Tensor
    target_grad: torch.Tensor


def select_rows(per_token: Any, rows: slice) -> Any:
    """The same `ShardStats` or `BackwardRows` for ``rows`` of the tokens only."""
    return type(per_token)(*(getattr(per_token, f.name)[rows] for f in fields(per_token)))


class StageBackend(Protocol):
    """What a backend provides; `lce.autograd` does the rest (TP merge, masking, reduction).

    Both backends also offer ``loss_grads_in_forward`` and ``loss_chunk_rows`` (see
    `TorchChunkedStages`): stats and the gradients of a loss whose upstream gradient is known, in
    one pass over the logits (the 3-GEMM paths of `lce.linear_cross_entropy`).
    """

    def forward_stats(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
    ) -> ShardStats:
        """Softmax statistics of the local shard.

        ``hidden [T, H]`` already in ``weight``'s dtype, ``weight [V_local, H]``, ``targets [T]``
        int64 global ids (ignored rows carry -1, owned by no shard).
        """
        ...

    def backward_grads(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
        rows: BackwardRows,
        need_hidden: bool,
        need_weight: bool,
        grad_hidden_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Gradients of ``sum_t g_lp[t] * logprob[t] + g_ent[t] * entropy[t]`` for the local shard.

        ``d_z = g_lp * (onehot - p) - g_ent * p * (z - E[z])`` as `BackwardRows` spells it out,
        ``d_logits = d_z * dz/da`` (``logit.dlogit_scale``). Returns ``grad_hidden [T, H]`` (this
        shard's partial sum) in fp32, or already in ``grad_hidden_dtype`` when given (rounded once
        from an fp32 accumulation; the caller sums no further), and ``grad_weight [V_local, H]``
        in fp32 or already in weight's dtype (rounded likewise), or None where not needed.
        """
        ...
