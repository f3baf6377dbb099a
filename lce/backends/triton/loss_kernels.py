"""Row kernels over materialized ``[rows, V_local]`` logits in weight's dtype (raw dots, mapped by
`tiles.logit_map` as they are read): the shard statistics, then d_logits (the 3-GEMM loss writes
them over its logits chunk in place; kept logits are read and d_logits written elsewhere).

The GEMMs around them are cuBLAS's (`lce.backends.gemm`); these kernels are memory-bound
sweeps, one program per token row walking the vocabulary in ascending tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lce.backends.base import BackwardRows
from lce.backends.triton.config import interpreting
from lce.backends.triton.operands import map_args
from lce.backends.triton.tiles import (
    LN2,
    centred_log2,
    log2_scale,
    logit_map,
    round_bf16_rne,
    softmax_dz,
)
from lce.options import LogitOptions

BLOCK_V = 2048  # 8 warps: 8 elements per thread per step
BLOCK_V_INTERPRETED = 256


@triton.jit
def _lane_stats_step(
    acc,
    lane_max,
    lane_nonmax,
    lane_sum_z,
    lane_sum_c,
    count,
    neg_scale2,
    in_v,
    MASKED: tl.constexpr,
    SMOOTHING: tl.constexpr,
):
    """Fold one element per lane into the lane statistics (see `_row_stats_kernel`), whose
    centred sums are in log2 units (``neg_scale2 = -k log2 e``).

    One exp per element: 2^(-|a - lane max| k log2 e) is the element's own term when it is not a
    new maximum, and the rescale of the lane's old terms when it is (the old max then joins the
    non-max sum). Unless ``MASKED``, every lane has seen an element (finite max); ``MASKED``
    also guards unseen lanes and those ``in_v`` leaves out (loaded as -inf). ``count``: the
    elements each lane folded before (``SMOOTHING``: their centred sum moves with a new max).
    """
    is_new = acc > lane_max  # never a masked (-inf) element
    if MASKED:
        ok = (lane_max > float("-inf")) & in_v  # no old terms (and no inf - inf) otherwise
        base = tl.where(ok, lane_max, 0.0)
    else:
        base = lane_max
    # Centred before the scale (the max lane's centred value exactly 0): a - max when a is
    # no new max, max_old - a when it is, both <= 0 and each rounded as `tiles.centred_log2`
    # rounds the lane in the forward and d_logits kernels. The bare ex2 (`tl.exp` multiplies by
    # log2 e again and guards subnormal results: 4 of the ~20 instructions an element, in a
    # sweep that was bound by them rather than by memory); terms below 2^-126 flush to 0.
    d = tl.abs(acc - base) * neg_scale2
    if MASKED:
        d = tl.where(ok, d, 0.0)
    t = tl.exp2(d)
    if MASKED:
        t = tl.where(ok, t, 0.0)
    total = 1.0 + lane_nonmax
    lane_sum_z = tl.where(is_new, t * (lane_sum_z + d * total), lane_sum_z + t * d)
    lane_nonmax = tl.where(is_new, t * total, lane_nonmax + t)
    if SMOOTHING:  # a new max shifts the old elements by d; its own centred value is 0
        lane_sum_c = tl.where(is_new, lane_sum_c + count * d, lane_sum_c + d)
    return tl.maximum(lane_max, acc), lane_nonmax, lane_sum_z, lane_sum_c


@triton.jit
def _mapped(
    row_ptr,
    bias_ptr,
    offs,
    mask,
    cap_scale,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The raw units and slopes (`tiles.logit_map`) of the logits row's columns ``offs``; where
    ``MASKED`` and not ``mask``, -inf (the map would turn a masked -inf into the cap's -1)."""
    if MASKED:
        acc = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.load(row_ptr + offs).to(tl.float32)
    bias = None
    if HAS_BIAS:
        if MASKED:
            bias = tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            bias = tl.load(bias_ptr + offs).to(tl.float32)
    acc, slope = logit_map(acc, bias, cap_scale, HAS_BIAS, SOFTCAP)
    if MASKED:
        acc = tl.where(mask, acc, float("-inf"))
    return acc, slope


# The logits rows' pointer, stride and V stay specialized (the sweep's vector loads and masks); the
# vocabulary offset, the stats plane and the per-row pointers (one scalar access each) are not.
@triton.jit(
    do_not_specialize=["plane", "vocab_start"],
    do_not_specialize_on_alignment=["targets_ptr", "stats_ptr", "bias_ptr"],
)  # fmt: skip
def _row_stats_kernel(
    logits_ptr,
    bias_ptr,
    targets_ptr,
    stats_ptr,
    plane,
    V,
    vocab_start,
    centred_scale,
    cap_scale,
    stride_lt,
    BLOCK_V: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SMOOTHING: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    row_ptr = logits_ptr + row * stride_lt
    # Per lane: a running max in raw units (centred before the scale, as the forward
    # kernel does, so the max lane's centred value is exactly 0), the sum of exp(z - max) over
    # the lane's elements but its max (whose term is exactly 1: kept apart, as `ShardStats`
    # asks) and the centred sums of z in log2 units. Lanes merge once at the end, back in natural
    # units: no cross-thread reduction in the sweep. The first whole tile only sets each lane's
    # max; the others run unmasked.
    scale2 = log2_scale(centred_scale)
    full_tiles = V // BLOCK_V
    lane_nonmax = tl.zeros((BLOCK_V,), dtype=tl.float32)
    lane_sum_z = tl.zeros((BLOCK_V,), dtype=tl.float32)
    lane_sum_c = tl.zeros((BLOCK_V,), dtype=tl.float32)
    lane_max = tl.full((BLOCK_V,), float("-inf"), dtype=tl.float32)
    if full_tiles > 0:
        lane_max, _ = _mapped(row_ptr, bias_ptr, cols, None, cap_scale, HAS_BIAS, SOFTCAP, False)
    for i in range(1, full_tiles):
        offs = i * BLOCK_V + cols
        acc, _ = _mapped(row_ptr, bias_ptr, offs, None, cap_scale, HAS_BIAS, SOFTCAP, False)
        lane_max, lane_nonmax, lane_sum_z, lane_sum_c = _lane_stats_step(
            acc, lane_max, lane_nonmax, lane_sum_z, lane_sum_c, i, -scale2, None, False,
            SMOOTHING,
        )  # fmt: skip
    if full_tiles * BLOCK_V < V:
        offs = full_tiles * BLOCK_V + cols
        in_v = offs < V
        acc, _ = _mapped(row_ptr, bias_ptr, offs, in_v, cap_scale, HAS_BIAS, SOFTCAP, True)
        lane_max, lane_nonmax, lane_sum_z, lane_sum_c = _lane_stats_step(
            acc, lane_max, lane_nonmax, lane_sum_z, lane_sum_c, full_tiles, -scale2, in_v,
            True, SMOOTHING,
        )  # fmt: skip
    # The target's logit: one load where this shard holds it (-1, ignored, is held by none).
    local_target = tl.load(targets_ptr + row) - vocab_start
    owned = (local_target >= 0) & (local_target < V)
    at = tl.where(owned, local_target, 0)
    target, _ = _mapped(row_ptr, bias_ptr, at, owned, cap_scale, HAS_BIAS, SOFTCAP, True)
    row_max = tl.max(lane_max, axis=0)
    seen = lane_max > float("-inf")
    shift = tl.where(seen, (lane_max - row_max) * scale2, 0.0)  # log2 units
    scale = tl.where(seen, tl.exp2(shift), 0.0)
    # One lane holding the row max keeps its max's 1 out; every other lane's max term joins.
    first_max = tl.min(tl.where(lane_max == row_max, cols, BLOCK_V), axis=0)
    own_max = tl.where(seen & (cols != first_max), scale, 0.0)
    out = stats_ptr + row
    tl.store(out, row_max)  # raw units (`ShardStats`)
    tl.store(out + plane, tl.sum(scale * lane_nonmax + own_max, axis=0))
    total = tl.where(seen, 1.0 + lane_nonmax, 0.0)
    tl.store(out + 2 * plane, tl.sum(scale * (lane_sum_z + shift * total), axis=0) * LN2)
    tl.store(out + 3 * plane, tl.where(owned, target, 0.0))
    sum_centred = 0.0
    if SMOOTHING:  # each lane's elements: the whole tiles, plus one if the tail reaches it
        elements = full_tiles + (full_tiles * BLOCK_V + cols < V).to(tl.int32)
        sum_centred = tl.sum(tl.where(seen, lane_sum_c + elements * shift, 0.0), axis=0) * LN2
    tl.store(out + 4 * plane, sum_centred)


def row_stats_into(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    vocab_start: int,
    logit: LogitOptions,
    out: torch.Tensor,
    block_v: int | None = None,
    num_warps: int = 8,
) -> None:
    """`ShardStats` of the logits ``logit`` forms from the raw dots ``logits`` (``[rows,
    V_local]``, unit column stride) and ``bias`` (``[V_local]`` contiguous, or None) against int64
    global ``targets`` (-1: ignored, owned by no shard), written into fp32 ``out[5, rows]`` (the
    `ShardStats` fields in order, unit row stride).

    ``block_v`` (elements per program step, default `BLOCK_V`) and ``num_warps``: for tuning.
    """
    num_rows, vocab = logits.shape
    _row_stats_kernel[(num_rows,)](
        logits_ptr=logits, bias_ptr=bias, targets_ptr=targets, stats_ptr=out,
        plane=out.stride(0), V=vocab, vocab_start=vocab_start, stride_lt=logits.stride(0),
        BLOCK_V=block_v or _block_v(), num_warps=num_warps, **map_args(logit, bias),
    )  # fmt: skip


@triton.jit(  # as `_row_stats_kernel`
    do_not_specialize=["vocab_start"],
    do_not_specialize_on_alignment=[
        "bias_ptr", "targets_ptr", "max_ptr", "log_sumexp_ptr", "centred_mean_ptr", "coef_ptr",
        "grad_entropy_ptr", "target_grad_ptr", "uniform_ptr",
    ],
)  # fmt: skip
def _row_dlogits_kernel(
    logits_ptr,
    out_ptr,
    bias_ptr,
    targets_ptr,
    max_ptr,
    log_sumexp_ptr,
    centred_mean_ptr,
    coef_ptr,
    grad_entropy_ptr,
    target_grad_ptr,
    uniform_ptr,
    V,
    vocab_start,
    centred_scale,
    cap_scale,
    stride_lt,
    stride_ot,
    BLOCK_V: tl.constexpr,
    BF16_INTERPRETED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SMOOTHING: tl.constexpr,
    ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    local_target = tl.load(targets_ptr + row) - vocab_start
    row_max = tl.load(max_ptr + row)
    log_sumexp = tl.load(log_sumexp_ptr + row)
    coef = tl.load(coef_ptr + row)
    target_grad = tl.load(target_grad_ptr + row)
    # Rows with zero upstream gradient (ignored tokens) get exactly 0, as in the backward kernel.
    active = (coef != 0.0) | (target_grad != 0.0)
    if SMOOTHING:
        uniform = tl.load(uniform_ptr + row)
        active |= uniform != 0.0
    centred_mean = 0.0
    g_ent = 0.0
    if ENTROPY:
        centred_mean = tl.load(centred_mean_ptr + row)
        g_ent = tl.load(grad_entropy_ptr + row)
        active |= g_ent != 0.0
    for tile_start in range(0, V, BLOCK_V):
        offs = tile_start + cols
        in_v = offs < V
        acc, slope = _mapped(
            logits_ptr + row * stride_lt, bias_ptr, offs, in_v, cap_scale, HAS_BIAS, SOFTCAP, True
        )
        # Centred before the scale, as the statistics were (`ShardStats`): no rounding at |z|.
        centred2 = centred_log2(acc, row_max, centred_scale)
        d = softmax_dz(centred2, log_sumexp, -coef, -g_ent, centred_mean, ENTROPY)
        if SMOOTHING:
            d += uniform
        d = tl.where(offs == local_target, target_grad, d) * slope
        d = tl.where(active, d, 0.0)
        if BF16_INTERPRETED:
            d = round_bf16_rne(d)  # the interpreter's bf16 cast truncates
        tl.store(out_ptr + row * stride_ot + offs, d.to(out_ptr.dtype.element_ty), mask=in_v)


def row_dlogits(
    logits: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    vocab_start: int,
    logit: LogitOptions,
    rows: BackwardRows,
    entropy: bool = False,
) -> None:
    """``out = (rows.uniform - p * (rows.softmax_coef + g_ent * (z - E[z]))) * slope`` off the
    target lane and ``rows.target_grad * slope`` on it (`BackwardRows`; 0 on a row whose
    coefficients are all 0): ``d_a`` of the logits ``logit`` forms from the raw dots ``logits``
    and ``bias`` (as `row_stats_into`), ``p`` their softmax, ``slope`` the softcap's.

    ``rows`` (fp32 ``[rows]``, contiguous; its ``max``/``log_sumexp`` as in `lce.tp.GlobalStats`)
    has its coefficients already times ``logit.dlogit_scale``; its entropy fields are read only
    with ``entropy`` (else ``g_ent`` is taken as 0). ``out`` (``[rows, V_local]``, unit column
    stride) may be ``logits`` itself: each element is read, then written, by the same thread.
    """
    num_rows, vocab = logits.shape
    _row_dlogits_kernel[(num_rows,)](
        logits_ptr=logits, out_ptr=out, bias_ptr=bias, targets_ptr=targets, max_ptr=rows.max,
        log_sumexp_ptr=rows.log_sumexp, centred_mean_ptr=rows.centred_mean,
        coef_ptr=rows.softmax_coef, grad_entropy_ptr=rows.grad_entropy,
        target_grad_ptr=rows.target_grad, uniform_ptr=rows.uniform, V=vocab,
        vocab_start=vocab_start, stride_lt=logits.stride(0), stride_ot=out.stride(0),
        BLOCK_V=_block_v(), BF16_INTERPRETED=interpreting() and out.dtype == torch.bfloat16,
        ENTROPY=entropy, num_warps=8, **map_args(logit, bias),
        # No FMA: each lane centred and rounded as the row statistics rounded it (see the backward
        # kernel).
        enable_fp_fusion=False,
    )  # fmt: skip


def _block_v() -> int:
    return BLOCK_V_INTERPRETED if interpreting() else BLOCK_V
