"""The two stages every backend implements, so one autograd function and one TP merge serve all.

A backend works on one rank's vocab shard and never materializes ``[T, V_local]`` logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax math and accumulation in fp32; fp64 inputs keep fp64 (exact-invariance checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class ShardStats:
    """Per-token softmax statistics of one vocab shard, all fp32 ``[T]``.

    With ``z = (hidden @ weight.T) / temperature`` restricted to the shard:
    ``max = max_j z_j`` (``-inf`` for an empty shard), ``sumexp = sum_j exp(z_j - max)``,
    ``sumexp_z = sum_j exp(z_j - max) * (z_j - max)`` (centred on the shard max, so entropy keeps
    its precision under huge common offsets), ``target_logit = z_y`` if the global target id ``y``
    lies in ``[vocab_start, vocab_start + V_local)`` else 0. An empty shard gives max = -inf and
    zeros elsewhere.
    """

    max: torch.Tensor
    sumexp: torch.Tensor
    sumexp_z: torch.Tensor
    target_logit: torch.Tensor


class StageBackend(Protocol):
    """What a backend provides; `lce.autograd` does the rest (TP merge, masking, reduction).

    A backend may also offer ``loss_grads_in_forward`` (see `TorchChunkedStages`): stats and the
    gradients of a scalar loss in one pass over the logits, which `lce.linear_cross_entropy` uses.
    """

    def forward_stats(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        temperature: float,
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
        temperature: float,
        row_max: torch.Tensor,
        log_sumexp: torch.Tensor,
        entropy: torch.Tensor,
        grad_logprob: torch.Tensor,
        grad_entropy: torch.Tensor,
        need_hidden: bool,
        need_weight: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Gradients of ``sum_t g_lp[t] * logprob[t] + g_ent[t] * entropy[t]`` for the local shard.

        ``row_max`` (m), ``log_sumexp`` (``log sum_j exp(z_j - m)``) and ``entropy`` are the
        *global* (all-shard) fp32 ``[T]`` values, kept apart so nothing is rounded at the logits'
        magnitude: ``log p = (z - m) - log_sumexp`` and ``z - E[z] = log p + entropy``.
        ``grad_logprob`` and ``grad_entropy`` are fp32 ``[T]`` of any stride (zero on ignored rows).
        ``d_z = g_lp * (onehot - p) - g_ent * p * (z - E[z])``, ``d_logits = d_z / temperature``.
        Returns fp32 ``grad_hidden [T, H]`` (this shard's partial sum) and ``grad_weight
        [V_local, H]`` in fp32 or already in weight's dtype (rounded once from an fp32
        accumulation), or None where not needed.
        """
        ...
