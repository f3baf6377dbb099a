"""Triton helpers shared by the forward and backward kernels: tile scheduling and one logits tile.

Everything here is ``@triton.jit`` device code; the torch-side launchers live in the kernel modules.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def grouped_tile(pid, num_row_tiles, num_col_tiles, GROUP: tl.constexpr):
    """Map a flat program id to (token tile, vocab tile) so GROUP token tiles share each vocab tile.

    Programs that run together then reuse the same weight tiles from L2 (the GEMM "swizzle").
    """
    width = GROUP * num_col_tiles
    group_id = pid // width
    first_row = group_id * GROUP
    group_rows = min(num_row_tiles - first_row, GROUP)
    row = first_row + (pid % width) % group_rows
    col = (pid % width) // group_rows
    return row, col


@triton.jit
def logits_tile(
    hidden_ptr,
    weight_ptr,
    rows,
    cols,
    H,
    stride_ht,
    stride_hh,
    stride_wv,
    stride_wh,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr,
    BF16_INTERPRETED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """fp32 ``[BLOCK_T, BLOCK_V]`` tile of ``hidden[rows] @ weight[cols].T`` (no temperature).

    ``rows``/``cols`` are int64 indices already clamped into range (padded lanes repeat a valid
    row/column; callers mask them). The H loop masks its tail unless ``EVEN_H``.
    """
    offs_h = tl.arange(0, BLOCK_H)
    h_ptrs = hidden_ptr + rows[:, None] * stride_ht + offs_h[None, :] * stride_hh
    w_ptrs = weight_ptr + cols[None, :] * stride_wv + offs_h[:, None] * stride_wh
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_H)):
        if EVEN_H:
            h = tl.load(h_ptrs)
            w = tl.load(w_ptrs)
        else:
            in_h = offs_h + k * BLOCK_H < H
            h = tl.load(h_ptrs, mask=in_h[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=in_h[:, None], other=0.0)
        if BF16_INTERPRETED:
            # TRITON_INTERPRET=1 computes bf16 tl.dot wrongly; fp32 operands are exact there.
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_H * stride_hh
        w_ptrs += BLOCK_H * stride_wh
    return acc


@triton.jit
def logits_tile_tma(
    hidden_desc,
    weight_desc,
    first_token,
    first_vocab,
    H,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BF16_INTERPRETED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """`logits_tile` through TMA descriptors: rows/columns past the end read as 0 (no masks)."""
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_H)):
        h = hidden_desc.load([first_token, k * BLOCK_H])
        w = weight_desc.load([first_vocab, k * BLOCK_H])
        if BF16_INTERPRETED:
            # TRITON_INTERPRET=1 computes bf16 tl.dot wrongly; fp32 operands are exact there.
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w.T, acc, input_precision=PRECISION)
    return acc


@triton.jit
def round_bf16_rne(x):
    """fp32 values rounded to the nearest bf16 (ties to even), still as fp32.

    The interpreter's fp32 -> bf16 cast truncates; rounding first makes that cast exact.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def reciprocal_1_2(d):
    """``1 / d`` for fp32 ``d`` in [1, 2], to about an ulp, on the FMA pipe: a linear start
    (``24/17 - 8/17 d``, relative error <= 1/17) and three Newton steps (error squared each:
    3.5e-3, 1.2e-5, 1.4e-10, then fp32 rounding). Explicit `tl.fma` throughout, as `accurate_tanh`.
    """
    r = tl.fma(-8.0 / 17.0, d, 24.0 / 17.0)
    r = tl.fma(r, tl.fma(-d, r, 1.0), r)
    r = tl.fma(r, tl.fma(-d, r, 1.0), r)
    r = tl.fma(r, tl.fma(-d, r, 1.0), r)
    return r


@triton.jit
def accurate_tanh(x):
    """``tanh(x)`` in fp32 to a few ulps (relative) on every range, from ``exp`` alone.

    Triton's interpreter has no libdevice, so one formula serves both modes: Cephes' odd
    polynomial below |x| = 0.625, else ``1 - q`` with ``q = 2 e / (1 + e)``, ``e = exp(-2|x|)``
    (never overflows). Written with explicit `tl.fma`, so kernels compiled with and without FMA
    contraction round ``tanh`` alike. The quotient uses `reciprocal_1_2` (FMA pipe) rather than
    a division, which costs a special-function op per lane next to the softmax's exp (H100,
    gemma2-8k, softcap 30, mean loss fwd+bwd: see docs/BENCHMARKS.md).
    """
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    q = (2.0 * e) * reciprocal_1_2(1.0 + e)
    small = ax < 0.625
    xs = tl.where(small, x, 0.0)  # the polynomial's branch, kept finite where it is not taken
    z = xs * xs
    poly = tl.fma(-5.70498872745e-3, z, 2.06390887954e-2)
    poly = tl.fma(poly, z, -5.37397155531e-2)
    poly = tl.fma(poly, z, 1.33314422036e-1)
    poly = tl.fma(poly, z, -3.33332819422e-1)
    near = tl.fma(xs, poly * z, xs)
    return tl.where(small, near, tl.where(x < 0, q - 1.0, 1.0 - q))


@triton.jit
def logit_map(acc, bias, cap_scale, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """The logit map of `lce.options.LogitOptions` on fp32 raw dots ``acc``: ``(r, slope)``.

    ``r``, the raw units the statistics centre on: ``a + b``, or with a softcap
    ``tanh(cap_scale (a + b))`` (``cap_scale = s / cap``); ``slope``: ``dz/da`` over
    ``s / T``, i.e. 1, or ``(1 - r)(1 + r)`` from the rounded ``r``, as the torch backend and
    PyTorch's tanh backward form it (off by up to ~2 ulps of 1 absolutely where ``r`` saturates;
    a second per-lane value from ``q`` kept its relative precision there but took 254 registers
    in the backward tile instead of 123, 4% slower at gemma2-8k: docs/BENCHMARKS.md).
    ``bias`` broadcasts against ``acc`` (read only when ``HAS_BIAS``). Every kernel maps its
    lanes here, so forward, backward and the loss rows agree bit for bit.
    """
    slope = 1.0
    if HAS_BIAS:
        acc = acc + bias
    if SOFTCAP:
        acc = accurate_tanh(acc * cap_scale)
        slope = (1.0 - acc) * (1.0 + acc)
    return acc, slope


@triton.jit
def log2_scale(centred_scale):
    """``k log2 e``: the multiplier that takes a centred raw difference to log2 units, formed once
    for every kernel that centres lanes (`centred_log2`, the row statistics' sweep)."""
    return centred_scale * LOG2E


@triton.jit
def centred_log2(acc, row_max, centred_scale):
    """A lane's centred logit in log2 units, ``(r - max) (k log2 e)`` of raw units ``acc`` and
    their row max ``row_max`` (broadcast): subtracted before the scale, so the max lane is exactly
    0 and nothing rounds at the logits' magnitude. Every kernel that centres a lane for an ``ex2``
    forms it here, so the forward's statistics and the backward's ``p`` round each lane alike."""
    return (acc - row_max) * log2_scale(centred_scale)


@triton.jit
def softmax_dz(centred2, log_sumexp, neg_coef, neg_g_ent, centred_mean, ENTROPY: tl.constexpr):
    """``d_z`` off the target lane, before label smoothing's uniform term
    (`lce.backends.base.BackwardRows`), from a lane's centred logit in log2 units, ``centred2 =
    (r - max) (k log2 e)`` rounded as the forward kernel rounds it, and its row's values (those
    of `BackwardRows`, the coefficients negated): ``p (neg_coef + neg_g_ent (c - centred_mean))``
    with ``p = exp(c - log_sumexp)``; without ``ENTROPY``, ``p neg_coef`` (``neg_g_ent`` and
    ``centred_mean`` unread). Both d_logits kernels, the tiled one and the rows over materialized
    logits, form it here.

    Per lane: a subtract, the bare ``ex2`` (the row values go to log2 units once a row; `tl.exp`
    multiplies every lane by log2 e and guards subnormal results: 1.6x the instructions), and
    with ``ENTROPY`` a subtract and one fma. Probabilities below 2^-126 flush to 0.
    """
    p = tl.exp2(centred2 - log_sumexp * LOG2E)
    if ENTROPY:
        return p * tl.fma(neg_g_ent * LN2, centred2 - centred_mean * LOG2E, neg_coef)
    return p * neg_coef
