"""Pure-PyTorch backend: the stages over token chunks, at most ``[chunk, V_local]`` logits at once.

Logits are ``hidden @ weight.T`` in the inputs' dtype (the stock path's rounding), then fp32 softmax
math (fp64 for fp64 inputs); both gradients accumulate in fp32 (one rounding at the end).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import fields

import torch

from lce.backends.base import BackwardRows, ShardStats, accumulation_dtype, select_rows
from lce.backends.gemm import addmm_, mm_into
from lce.options import LogitOptions
from lce.tp import GlobalStats

# Elements of one [chunk, V_local] fp32 block: 16 Mi = 64 MiB, so peak stays a few such blocks.
DEFAULT_CHUNK_ELEMENTS = 1 << 24

# (chunk stats, rows) -> global statistics of those rows
GlobalMerge = Callable[[ShardStats, slice], GlobalStats]


class TorchChunkedStages:
    """Token-chunked forward statistics and gradients; works on any device torch supports."""

    def __init__(self, chunk_size: int | None = None) -> None:
        """``chunk_size``: tokens per chunk (checked by `lce.options.LCEOptions`); None: ~64 MiB
        of fp32 logits per chunk."""
        self.chunk_size = chunk_size

    def _chunks(self, num_tokens: int, vocab_local: int) -> Iterator[slice]:
        size = self.loss_chunk_rows(num_tokens, vocab_local, 0)
        return (slice(start, start + size) for start in range(0, num_tokens, size))

    def loss_chunk_rows(self, num_tokens: int, vocab_local: int, itemsize: int) -> int:
        """Tokens per chunk: ``chunk_size``, else ~64 MiB of fp32 logits (``itemsize`` unused)."""
        return self.chunk_size or default_chunk_size(vocab_local)

    def forward_stats(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
    ) -> ShardStats:
        stats = _empty_stats(hidden, weight)
        if weight.shape[0] == 0:
            return stats
        local, owned = _local_targets(targets, vocab_start, weight.shape[0])
        for rows in self._chunks(hidden.shape[0], weight.shape[0]):
            logits = _logits(hidden[rows], weight)
            _chunk_stats(logits, local[rows], owned[rows], stats, rows, logit)
        return stats

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
        """Token chunks over the whole shard: each row of grad_hidden is one GEMM, written in
        ``grad_hidden_dtype`` when that is weight's (its one rounding), else in fp32."""
        rounded = grad_hidden_dtype == weight.dtype
        grad_hidden, grad_weight = _grad_buffers(hidden, weight, need_hidden, need_weight, rounded)
        if weight.shape[0] == 0:
            return grad_hidden, grad_weight
        local, owned = _local_targets(targets, vocab_start, weight.shape[0])
        for chunk in self._chunks(hidden.shape[0], weight.shape[0]):
            logits = _logits(hidden[chunk], weight)
            d = _chunk_dlogits(logits, select_rows(rows, chunk), local[chunk], owned[chunk], logit)
            _accumulate(d, hidden, weight, chunk, grad_hidden, grad_weight)
        return grad_hidden, grad_weight

    def grads_with_graph(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
        grad_logprob: torch.Tensor,
        grad_entropy: torch.Tensor,
        need_hidden: bool,
        need_weight: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`backward_grads` as differentiable torch ops, for a backward with ``create_graph``.

        One shard holding the whole vocabulary (no TP). ``hidden`` is the caller's tensor (its
        cast to weight's dtype is differentiated too); gradients come back in the inputs' dtypes.
        The logits are materialized whole: a second-order graph keeps them anyway.
        """
        compute_hidden = hidden.to(weight.dtype)
        raw = (compute_hidden @ weight.T).to(accumulation_dtype(weight.dtype))
        logits = raw * logit.dlogit_scale
        log_p = torch.log_softmax(logits, dim=-1)
        local, owned = _local_targets(targets, vocab_start, weight.shape[0])
        logprobs = torch.where(owned, log_p.gather(1, local[:, None]).squeeze(1), 0.0)
        entropy = torch.logsumexp(logits, dim=-1) - (log_p.exp() * logits).sum(dim=-1)
        inputs = [tensor for tensor, need in ((hidden, need_hidden), (weight, need_weight)) if need]
        upstream = (grad_logprob.to(logprobs.dtype), grad_entropy.to(entropy.dtype))
        grads = list(torch.autograd.grad((logprobs, entropy), inputs, upstream, create_graph=True))
        return grads.pop(0) if need_hidden else None, grads.pop(0) if need_weight else None

    def loss_grads_in_forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
        merge: GlobalMerge,
        grad_logprob: torch.Tensor,
        need_hidden: bool,
        need_weight: bool,
        grad_weight_out: torch.Tensor | None = None,
        chunk_rows: int | None = None,
    ) -> tuple[ShardStats, torch.Tensor | None, torch.Tensor | None]:
        """Forward statistics and the gradients of ``sum(grad_logprob * logprobs)`` in one pass.

        For a loss whose upstream gradient is known before backward (sum/mean): each chunk's
        logits are computed once (3 GEMMs in all instead of 4). ``merge(stats, rows)`` turns the
        chunk's shard stats into the global row stats of those rows (TP collectives included).
        ``grad_weight_out``: an fp32 (fp64 for fp64 weights) ``[V_local, H]`` buffer the weight
        gradient is added to (and returned) instead of a new zeroed one. ``chunk_rows``: tokens
        per chunk (default `loss_chunk_rows`); under TP every rank must use the same, since each
        chunk merges its rows over the group (an empty shard merges its empty statistics).
        """
        stats = _empty_stats(hidden, weight)
        grad_hidden, grad_weight = _grad_buffers(
            hidden, weight, need_hidden, need_weight and grad_weight_out is None
        )
        if need_weight and grad_weight_out is not None:
            grad_weight = grad_weight_out
        step = chunk_rows or self.loss_chunk_rows(hidden.shape[0], weight.shape[0], 0)
        local, owned = _local_targets(targets, vocab_start, weight.shape[0])
        for start in range(0, hidden.shape[0], step):
            rows = slice(start, start + step)
            if weight.shape[0] == 0:
                merge(stats, rows)
                continue
            logits = _logits(hidden[rows], weight)
            e = _chunk_stats(logits, local[rows], owned[rows], stats, rows, logit)
            del logits
            merged = merge(stats, rows)
            # p = exp(z - m_local) * exp(m_local - M - log_sumexp): one multiply, not another exp.
            shift = (stats.max[rows] - merged.max) * logit.centred_scale
            to_p = torch.exp(shift - merged.log_sumexp)
            g_lp = grad_logprob[rows].to(e.dtype) * logit.dlogit_scale
            d = e.mul_((-g_lp * to_p)[:, None])
            _set_target_lane(d, local[rows], owned[rows], g_lp * merged.target_complement)
            _accumulate(d, hidden, weight, rows, grad_hidden, grad_weight)
        return stats, grad_hidden, grad_weight


def default_chunk_size(vocab_local: int) -> int:
    """Tokens per chunk when none is given: about `DEFAULT_CHUNK_ELEMENTS` logits."""
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab_local, 1))


def _empty_stats(hidden: torch.Tensor, weight: torch.Tensor) -> ShardStats:
    acc = accumulation_dtype(weight.dtype)
    out = torch.zeros(len(fields(ShardStats)), hidden.shape[0], dtype=acc, device=hidden.device)
    if weight.shape[0] == 0:
        out[0] = -torch.inf
    return ShardStats(*out.unbind(0))


def _grad_buffers(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    need_hidden: bool,
    need_weight: bool,
    hidden_in_weight_dtype: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    acc = dict(dtype=accumulation_dtype(weight.dtype), device=hidden.device)
    hidden_dtype = weight.dtype if hidden_in_weight_dtype else acc["dtype"]
    return (
        torch.zeros(hidden.shape, dtype=hidden_dtype, device=hidden.device)
        if need_hidden
        else None,
        torch.zeros(weight.shape, **acc) if need_weight else None,
    )


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Raw dots ``hidden @ weight.T``; the scale comes after centring (see `ShardStats`)."""
    return (hidden @ weight.T).to(accumulation_dtype(weight.dtype))


def _local_targets(
    targets: torch.Tensor, vocab_start: int, vocab_local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard-local target column (clamped, for gather) and whether this shard owns it."""
    local = targets - vocab_start
    owned = (local >= 0) & (local < vocab_local)
    return local.clamp(0, max(vocab_local - 1, 0)), owned


def _chunk_stats(
    logits: torch.Tensor,
    local: torch.Tensor,
    owned: torch.Tensor,
    stats: ShardStats,
    rows: slice,
    logit: LogitOptions,
) -> torch.Tensor:
    """Write the chunk's shard stats into ``stats[rows]``; centres and scales ``logits`` in place
    into ``z - shard max`` and returns its ``exp``."""
    picked = logits.gather(1, local[:, None]).squeeze(1)
    stats.target_logit[rows] = torch.where(owned, picked, torch.zeros_like(picked))
    row_max, max_lane = logits.max(dim=1, keepdim=True)
    stats.max[rows] = row_max.squeeze(1)
    z = _centred(logits, row_max, logit.centred_scale)
    e = torch.exp(z)
    stats.sumexp_z[rows] = (e.unsqueeze(1) @ z.unsqueeze(2)).view(-1)
    # The max lane's exp(0) = 1 leaves the sum by a second pass, not by subtraction (sumexp - 1
    # cancels on confident rows).
    e.scatter_(1, max_lane, 0.0)
    stats.sumexp_nonmax[rows] = e.sum(dim=1)
    e.scatter_(1, max_lane, 1.0)
    return e


def _centred(logits: torch.Tensor, row_max: torch.Tensor, scale: float) -> torch.Tensor:
    """``(logits - row_max) * scale`` in place: the max lane exactly 0, forward and backward
    alike."""
    logits.sub_(row_max)
    if scale != 1.0:
        logits.mul_(scale)
    return logits


def _chunk_dlogits(
    logits: torch.Tensor,
    rows: BackwardRows,
    local: torch.Tensor,
    owned: torch.Tensor,
    logit: LogitOptions,
) -> torch.Tensor:
    """``d_logits = d_z * dz/da`` of the chunk (see `BackwardRows`), in ``logits``' buffer."""
    g_lp = rows.grad_logprob[:, None].to(logits.dtype) * logit.dlogit_scale
    g_ent = rows.grad_entropy[:, None].to(logits.dtype) * logit.dlogit_scale
    centred = _centred(logits, rows.max[:, None], logit.centred_scale)
    p = (centred - rows.log_sumexp[:, None]).exp_()
    d = centred.sub_(rows.centred_mean[:, None]).mul_(g_ent).add_(g_lp).mul_(p).neg_()
    _set_target_lane(d, local, owned, rows.target_grad.to(logits.dtype) * logit.dlogit_scale)
    return d


def _set_target_lane(
    values: torch.Tensor, local: torch.Tensor, owned: torch.Tensor, target_values: torch.Tensor
) -> None:
    """``values[t, local[t]] = target_values[t]`` on the rows whose target this shard owns."""
    current = values.gather(1, local[:, None]).squeeze(1)
    values.scatter_(1, local[:, None], torch.where(owned, target_values, current)[:, None])


def _accumulate(
    d: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: slice,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
) -> None:
    """grad_hidden[rows] = d @ W; grad_weight += d.T @ hidden[rows].

    ``d`` is rounded to weight's dtype (the stock path's d_logits); the products are summed in the
    fp32 buffers, so grad_weight is rounded to a low-precision dtype once, at the end, whatever
    the number of chunks (a per-chunk rounding made the error grow with the chunk count).
    """
    d = d.to(weight.dtype)
    if grad_hidden is not None:
        mm_into(d, weight, out=grad_hidden[rows])
    if grad_weight is not None:
        addmm_(grad_weight, d.T, hidden[rows])
