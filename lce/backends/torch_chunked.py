"""Pure-PyTorch backend: the stages over token chunks, at most ``[chunk, V_local]`` logits at once.

Logits are ``hidden @ weight.T`` in the inputs' dtype (the stock path's rounding), then the logit
map (`raw_units`) and the softmax math in fp32 (fp64 for fp64 inputs); every gradient accumulates
in fp32 (one rounding at the end).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields

import torch

from lce.backends.base import (
    BackwardRows,
    GlobalMerge,
    Grads,
    ShardStats,
    Wanted,
    accumulation_dtype,
    select_rows,
)
from lce.backends.gemm import addmm_, mm_into
from lce.options import LogitOptions

# Elements of one [chunk, V_local] fp32 block: 16 Mi = 64 MiB, so peak stays a few such blocks.
DEFAULT_CHUNK_ELEMENTS = 1 << 24


class TorchChunkedStages:
    """Token-chunked forward statistics and gradients; works on any device torch supports."""

    def __init__(self, chunk_size: int | None = None) -> None:
        """``chunk_size``: tokens per chunk (checked by `lce.options.LCEOptions`); None: ~64 MiB
        of fp32 logits per chunk."""
        self.chunk_size = chunk_size

    def _chunks(self, num_tokens: int, vocab_local: int) -> Iterator[slice]:
        size = self.loss_chunk_rows(num_tokens, vocab_local, 0, 0)
        return (slice(start, start + size) for start in range(0, num_tokens, size))

    def loss_chunk_rows(
        self, num_tokens: int, vocab_local: int, hidden_size: int, itemsize: int
    ) -> int:
        """Tokens per chunk: ``chunk_size``, else ~64 MiB of fp32 logits (``hidden_size`` and
        ``itemsize`` unused)."""
        return self.chunk_size or default_chunk_size(vocab_local)

    def forward_stats(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
        kept: torch.Tensor | None = None,
    ) -> ShardStats:
        stats = _empty_stats(hidden, weight)
        if weight.shape[0] == 0:
            return stats
        local, owned = _local_targets(targets, vocab_start, weight.shape[0])
        for rows in self._chunks(hidden.shape[0], weight.shape[0]):
            if kept is None:
                dots = _logits(hidden[rows], weight)
            else:
                dots = _kept_dots(hidden[rows], weight, kept[rows])
            raw = _raw(dots, bias, logit)
            _chunk_stats(raw, local[rows], owned[rows], stats, rows, logit)
        return stats

    def backward_grads(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
        rows: BackwardRows,
        wanted: Wanted,
        grad_hidden_dtype: torch.dtype | None = None,
        kept: torch.Tensor | None = None,
        kept_writable: bool = False,
    ) -> Grads:
        """Token chunks over the whole shard: each row of grad_hidden is one GEMM, written in
        ``grad_hidden_dtype`` when that is weight's (its one rounding), else in fp32. ``kept``
        is read only (its dots are copied to fp32 either way), whatever ``kept_writable``."""
        rounded = grad_hidden_dtype == weight.dtype
        grads = _grad_buffers(hidden, weight, wanted, rounded)
        if weight.shape[0] == 0:
            return grads
        local, owned = _local_targets(targets, vocab_start, weight.shape[0])
        for chunk in self._chunks(hidden.shape[0], weight.shape[0]):
            if kept is None:
                dots = _logits(hidden[chunk], weight)
            else:  # a copy: the kept dots stay for a second backward
                dots = kept[chunk].to(accumulation_dtype(weight.dtype), copy=True)
            raw = _raw(dots, bias, logit)
            slope = cap_slope(raw, logit)
            d = _chunk_dlogits(raw, select_rows(rows, chunk), local[chunk], owned[chunk], logit)
            _accumulate(d if slope is None else d.mul_(slope), hidden, weight, chunk, grads)
        return grads

    def stats_with_graph(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
    ) -> tuple[torch.Tensor, ...]:
        """The four token statistics of `lce.autograd.token_statistics` as differentiable torch
        ops, for a backward with ``create_graph`` (`lce.autograd.grads_with_graph`).

        One shard holding the whole vocabulary (no TP). ``hidden`` is the caller's tensor (its
        cast to weight's dtype is differentiated too). The logits are materialized whole: a
        second-order graph keeps them anyway. Not masked: ignored rows are the caller's.
        """
        logits = _raw(_logits(hidden.to(weight.dtype), weight), bias, logit)
        logits = logits * logit.centred_scale  # z = k r, `LogitOptions`
        log_p = torch.log_softmax(logits, dim=-1)
        local, owned = _local_targets(targets, vocab_start, weight.shape[0])
        lse = torch.logsumexp(logits, dim=-1)
        return (
            torch.where(owned, log_p.gather(1, local[:, None]).squeeze(1), 0.0),
            lse - (log_p.exp() * logits).sum(dim=-1),
            lse,
            -log_p.mean(dim=-1),
        )

    def loss_grads_in_forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
        merge: GlobalMerge,
        wanted: Wanted,
        grad_weight_out: torch.Tensor | None = None,
        chunk_rows: int | None = None,
    ) -> tuple[ShardStats, Grads]:
        """Forward statistics and the gradients of a loss known before backward, in one pass.

        For a loss whose upstream gradient is known before backward (sum/mean): each chunk's
        logits are computed once (3 GEMMs in all instead of 4). ``merge(stats, rows)`` turns the
        chunk's shard stats into the backward rows of those tokens (TP collectives included).
        ``grad_weight_out``: an fp32 (fp64 for fp64 weights) ``[V_local, H]`` buffer the weight
        gradient is added to (and returned) instead of a new zeroed one. ``chunk_rows``: tokens
        per chunk (default `loss_chunk_rows`); under TP every rank must use the same, since each
        chunk merges its rows over the group (an empty shard merges its empty statistics).
        """
        stats = _empty_stats(hidden, weight)
        own_weight = wanted._replace(weight=wanted.weight and grad_weight_out is None)
        grads = _grad_buffers(hidden, weight, own_weight)
        if wanted.weight and grad_weight_out is not None:
            grads = grads._replace(weight=grad_weight_out)
        step = chunk_rows or self.loss_chunk_rows(hidden.shape[0], weight.shape[0], 0, 0)
        local, owned = _local_targets(targets, vocab_start, weight.shape[0])
        for start in range(0, hidden.shape[0], step):
            rows = slice(start, start + step)
            if weight.shape[0] == 0:
                merge(stats, rows)
                continue
            raw = _raw(_logits(hidden[rows], weight), bias, logit)
            slope = cap_slope(raw, logit)
            e = _chunk_stats(raw, local[rows], owned[rows], stats, rows, logit)
            del raw
            merged = merge(stats, rows)
            # p = exp(z - m_local) * exp(m_local - M - log_sumexp): one multiply, not another exp.
            shift = (stats.max[rows] - merged.max) * logit.centred_scale
            to_p = torch.exp(shift - merged.log_sumexp)
            scaled = _scaled_rows(merged, logit, e.dtype)
            d = e.mul_((-scaled.softmax_coef * to_p)[:, None])
            if logit.label_smoothing > 0:
                d.add_(scaled.uniform[:, None])
            _set_target_lane(d, local[rows], owned[rows], scaled.target_grad)
            _accumulate(d if slope is None else d.mul_(slope), hidden, weight, rows, grads)
        return stats, grads


def default_chunk_size(vocab_local: int) -> int:
    """Tokens per chunk when none is given: about `DEFAULT_CHUNK_ELEMENTS` logits."""
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab_local, 1))


def raw_units(logits: torch.Tensor, logit: LogitOptions) -> torch.Tensor:
    """The raw units ``r`` of `LogitOptions` from ``a + b`` (in place): with a softcap
    ``tanh(s (a + b) / cap)``, else ``a + b`` itself. Differentiable (for the double backward)."""
    if logit.softcap is None:
        return logits
    return logits.mul_(logit.cap_scale).tanh_()


def cap_slope(raw: torch.Tensor, logit: LogitOptions) -> torch.Tensor | None:
    """The softcap's ``1 - tanh^2 = (1 - r)(1 + r)`` per lane (``dz/da`` over ``s / T``), or None
    without a cap (slope 1)."""
    if logit.softcap is None:
        return None
    return (1.0 - raw).mul_(1.0 + raw)


def _empty_stats(hidden: torch.Tensor, weight: torch.Tensor) -> ShardStats:
    acc = accumulation_dtype(weight.dtype)
    out = torch.zeros(len(fields(ShardStats)), hidden.shape[0], dtype=acc, device=hidden.device)
    if weight.shape[0] == 0:
        out[0] = -torch.inf
    return ShardStats(*out.unbind(0))


def _grad_buffers(
    hidden: torch.Tensor, weight: torch.Tensor, wanted: Wanted, hidden_in_weight_dtype: bool = False
) -> Grads:
    acc = dict(dtype=accumulation_dtype(weight.dtype), device=hidden.device)
    hidden_dtype = weight.dtype if hidden_in_weight_dtype else acc["dtype"]
    return Grads(
        torch.zeros(hidden.shape, dtype=hidden_dtype, device=hidden.device)
        if wanted.hidden
        else None,
        torch.zeros(weight.shape, **acc) if wanted.weight else None,
        torch.zeros(weight.shape[0], **acc) if wanted.bias else None,
    )


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Raw dots ``hidden @ weight.T`` (the GEMM's rounding) in the accumulation dtype."""
    return (hidden @ weight.T).to(accumulation_dtype(weight.dtype))


def _kept_dots(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`_logits`, the GEMM writing ``out`` (weight's dtype: the kept logits); a copy in the
    accumulation dtype, which the callers change in place."""
    torch.mm(hidden, weight.T, out=out)
    return out.to(accumulation_dtype(weight.dtype), copy=True)


def _raw(logits: torch.Tensor, bias: torch.Tensor | None, logit: LogitOptions) -> torch.Tensor:
    """The lanes' `raw_units` from `_logits` plus the bias (added in the accumulation dtype);
    the scale comes after centring (see `ShardStats`). In place where ``logits`` is a fresh
    tensor of the accumulation dtype."""
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    return raw_units(logits, logit)


def _local_targets(
    targets: torch.Tensor, vocab_start: int, vocab_local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard-local target column (clamped, for gather) and whether this shard owns it."""
    local = targets - vocab_start
    owned = (local >= 0) & (local < vocab_local)
    return local.clamp(0, max(vocab_local - 1, 0)), owned


def _chunk_stats(
    raw: torch.Tensor,
    local: torch.Tensor,
    owned: torch.Tensor,
    stats: ShardStats,
    rows: slice,
    logit: LogitOptions,
) -> torch.Tensor:
    """Write the chunk's shard stats into ``stats[rows]``; centres and scales ``raw`` in place
    into ``z - shard max`` and returns its ``exp``."""
    picked = raw.gather(1, local[:, None]).squeeze(1)
    stats.target_logit[rows] = torch.where(owned, picked, torch.zeros_like(picked))
    row_max, max_lane = raw.max(dim=1, keepdim=True)
    stats.max[rows] = row_max.squeeze(1)
    z = _centred(raw, row_max, logit.centred_scale)
    if logit.label_smoothing > 0:
        stats.sum_centred[rows] = z.sum(dim=1)
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


def _scaled_rows(rows: BackwardRows, logit: LogitOptions, dtype: torch.dtype) -> BackwardRows:
    """``rows`` with every ``d_z`` coefficient times ``s / T`` (per row, not per lane): ``d_a``
    then needs only the cap's slope."""
    scale = logit.dlogit_scale
    return BackwardRows(
        *(rows.max, rows.log_sumexp, rows.centred_mean),
        *(getattr(rows, name).to(dtype) * scale for name in _COEFFICIENTS),
    )


_COEFFICIENTS = ("softmax_coef", "grad_entropy", "target_grad", "uniform")


def _chunk_dlogits(
    raw: torch.Tensor,
    rows: BackwardRows,
    local: torch.Tensor,
    owned: torch.Tensor,
    logit: LogitOptions,
) -> torch.Tensor:
    """``d_z * s / T`` of the chunk (see `BackwardRows`) in ``raw``'s buffer; ``d_a`` is this
    times the cap's slope."""
    scaled = _scaled_rows(rows, logit, raw.dtype)
    centred = _centred(raw, rows.max[:, None], logit.centred_scale)
    p = (centred - rows.log_sumexp[:, None]).exp_()
    d = centred.sub_(rows.centred_mean[:, None]).mul_(scaled.grad_entropy[:, None])
    d = d.add_(scaled.softmax_coef[:, None]).mul_(p).neg_()
    if logit.label_smoothing > 0:
        d.add_(scaled.uniform[:, None])
    _set_target_lane(d, local, owned, scaled.target_grad)
    return d


def _set_target_lane(
    values: torch.Tensor, local: torch.Tensor, owned: torch.Tensor, target_values: torch.Tensor
) -> None:
    """``values[t, local[t]] = target_values[t]`` on the rows whose target this shard owns."""
    current = values.gather(1, local[:, None]).squeeze(1)
    values.scatter_(1, local[:, None], torch.where(owned, target_values, current)[:, None])


def _accumulate(
    d: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, rows: slice, grads: Grads
) -> None:
    """grad_hidden[rows] = d @ W; grad_weight += d.T @ hidden[rows]; grad_bias += sum_t d.

    ``d`` is rounded to weight's dtype (the stock path's d_logits); the products are summed in the
    fp32 buffers, so grad_weight is rounded to a low-precision dtype once, at the end, whatever
    the number of chunks (a per-chunk rounding made the error grow with the chunk count).
    """
    d = d.to(weight.dtype)
    if grads.hidden is not None:
        mm_into(d, weight, out=grads.hidden[rows])
    if grads.weight is not None:
        addmm_(grads.weight, d.T, hidden[rows])
    if grads.bias is not None:
        grads.bias.add_(d.sum(dim=0, dtype=grads.bias.dtype))
