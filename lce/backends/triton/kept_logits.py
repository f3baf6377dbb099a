"""Opt-in 3-GEMM per-token path: logits kept from the forward for the backward
(`TritonConfig.keep_logits_bytes`).

Forward: cuBLAS writes the ``[T, V_local]`` logits in weight's dtype (GEMM 1) and
`loss_kernels.row_stats_into` takes the shard statistics from them. Backward: d_logits written
over the same memory (`loss_kernels.row_dlogits_with_entropy`), then grad_hidden (GEMM 2) and
grad_weight (GEMM 3), each rounded once from cuBLAS's fp32 accumulation (`lce.backends.gemm`).
The softmax then sees logits rounded to weight's dtype, as in the 3-GEMM scalar loss, where the
fused forward and backward kernels keep fp32 dots.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from lce.backends.base import BackwardRows, ShardStats
from lce.backends.gemm import mm_into
from lce.backends.triton.loss_kernels import row_dlogits_with_entropy, row_stats_into


@dataclass
class KeptLogits:
    """The raw dots ``hidden @ weight.T`` of one forward, in weight's dtype, for its backward."""

    logits: torch.Tensor

    def matches(self, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether these are the logits of ``hidden`` and ``weight`` (same shapes and dtype)."""
        expected = (hidden.shape[0], weight.shape[0])
        return tuple(self.logits.shape) == expected and self.logits.dtype == weight.dtype


def fits(num_tokens: int, weight: torch.Tensor, budget: int) -> bool:
    """Whether ``[num_tokens, V_local]`` logits in weight's dtype fit ``budget`` bytes."""
    return 0 < num_tokens * weight.shape[0] * weight.element_size() <= budget


def forward_with_kept_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    temperature: float,
) -> tuple[ShardStats, KeptLogits]:
    """`ShardStats` of the stored logits (``targets`` int64, contiguous) and the logits kept."""
    num_tokens, vocab_local = hidden.shape[0], weight.shape[0]
    logits = torch.empty(num_tokens, vocab_local, dtype=weight.dtype, device=hidden.device)
    mm_into(hidden, weight.T, out=logits)
    stats = torch.empty(
        len(fields(ShardStats)), num_tokens, dtype=torch.float32, device=hidden.device
    )
    row_stats_into(logits, targets, vocab_start, temperature, stats)
    return ShardStats(*stats.unbind(0)), KeptLogits(logits)


def backward_from_kept_logits(
    kept: KeptLogits,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    temperature: float,
    rows: BackwardRows,
    grads_wanted: tuple[bool, bool],
    dtypes: tuple[torch.dtype, torch.dtype],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """grad_hidden and grad_weight (in ``dtypes``, or None where not in ``grads_wanted``) from
    the kept logits, which become d_logits in place (so they serve one backward only)."""
    rows = BackwardRows(*(getattr(rows, f.name).float().contiguous() for f in fields(rows)))
    d_logits = kept.logits
    row_dlogits_with_entropy(d_logits, targets, vocab_start, temperature, rows)
    need_hidden, need_weight = grads_wanted
    grad_hidden = grad_weight = None
    if need_hidden:
        grad_hidden = torch.empty(hidden.shape, dtype=dtypes[0], device=hidden.device)
        mm_into(d_logits, weight, out=grad_hidden)
    if need_weight:
        grad_weight = torch.empty(weight.shape, dtype=dtypes[1], device=weight.device)
        mm_into(d_logits.T, hidden, out=grad_weight)
    return grad_hidden, grad_weight
