"""Backward stage, part 1: recompute a ``[T, chunk]`` logits block and write its d_logits.

``d_z = -p * (softmax_coef + g_ent * (z - E[z])) + uniform`` in fp32 as `BackwardRows` spells it
out (centred on the row max; `tiles.softmax_dz`), ``d_a = d_z * dz/da`` (``s / T`` times the
softcap's slope, `tiles.logit_map`; the rows come already times ``s / T``), stored once in the
weight's dtype so the two gradient GEMMs (`stages`) run on tensor cores. Every lane takes that
formula, the target lane too: `target_kernel` writes its value over it (see there why). The
buffer is one vocab chunk, never ``[T, V]`` unless V fits the chunk budget.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lce.backends.base import BackwardRows
from lce.backends.triton.config import TritonConfig
from lce.backends.triton.operands import map_args, operand_args
from lce.backends.triton.target_kernel import place_target_dlogits
from lce.backends.triton.tiles import (
    centred_log2,
    grouped_tile,
    logit_map,
    logits_tile,
    logits_tile_tma,
    round_bf16_rne,
    softmax_dz,
)
from lce.options import LogitOptions


# Specialized as in forward_kernel._forward_partials_kernel: H, the operands' strides and alignment,
# d_logits' pointer and row stride (its rows are padded to 16 elements) and C's divisibility by 16
# alone (C_DIV16: the store mask, which keeps the stores 16 bytes wide). T and the per-token
# rows (one scalar load each) only mask and feed the epilogue.
@triton.jit(
    do_not_specialize=["T", "C"],
    do_not_specialize_on_alignment=[
        "bias_ptr", "max_ptr", "log_sumexp_ptr", "centred_mean_ptr",
        "softmax_coef_ptr", "grad_entropy_ptr", "target_grad_ptr", "uniform_ptr",
    ],
)  # fmt: skip
def _dlogits_kernel(
    hidden,
    weight,
    bias_ptr,
    max_ptr,
    log_sumexp_ptr,
    centred_mean_ptr,
    softmax_coef_ptr,
    grad_entropy_ptr,
    target_grad_ptr,
    uniform_ptr,
    dlogits_ptr,
    T,
    C,
    H,
    centred_scale,
    cap_scale,
    stride_ht,
    stride_hh,
    stride_wv,
    stride_wh,
    stride_dt,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN_H: tl.constexpr,
    BF16_INTERPRETED: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    C_DIV16: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SMOOTHING: tl.constexpr,
):
    if C_DIV16:  # as V_DIV16 in the forward
        C = (C >> 4) << 4
    pid_t, pid_v = grouped_tile(tl.program_id(0), tl.cdiv(T, BLOCK_T), tl.cdiv(C, BLOCK_V), GROUP)
    offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_t = offs_t < T
    in_v = offs_v < C
    rows = offs_t % T
    if USE_TMA:
        acc = logits_tile_tma(
            hidden, weight, pid_t * BLOCK_T, pid_v * BLOCK_V, H,
            BLOCK_T, BLOCK_V, BLOCK_H, BF16_INTERPRETED, PRECISION,
        )  # fmt: skip
    else:
        acc = logits_tile(
            hidden, weight, rows, offs_v % C, H, stride_ht, stride_hh, stride_wv, stride_wh,
            BLOCK_T, BLOCK_V, BLOCK_H, EVEN_H, BF16_INTERPRETED, PRECISION,
        )  # fmt: skip
    bias = None
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_v, mask=in_v, other=0.0).to(tl.float32)[None, :]
    acc, slope = logit_map(acc, bias, cap_scale, HAS_BIAS, SOFTCAP)
    row_max = tl.load(max_ptr + rows)  # raw units, as the forward's running max
    log_sumexp = tl.load(log_sumexp_ptr + rows)
    centred_mean = tl.load(centred_mean_ptr + rows)
    coef = tl.load(softmax_coef_ptr + rows)
    g_ent = tl.load(grad_entropy_ptr + rows)
    target_grad = tl.load(target_grad_ptr + rows)
    # Rows with zero upstream gradient (ignored tokens) get 0 (their target lane's too:
    # `target_kernel.target_dlogits`): their coefficients are all 0 and a log-sum-exp of +inf
    # makes their p 0, so finite logits give 0 with no per-lane select (the compiler moved one
    # past the bf16 cast, 2 instructions a lane: docs/BENCHMARKS.md).
    active = (coef != 0.0) | (g_ent != 0.0) | (target_grad != 0.0)
    if SMOOTHING:
        uniform = tl.load(uniform_ptr + rows)
        active |= uniform != 0.0
    log_sumexp = tl.where(active, log_sumexp, float("inf"))
    # Centred before the scale exactly as the forward centred the lane (z - max z rounded once,
    # relative to the lane's distance from the max): scaling first and subtracting the rounded
    # max z left ~2^-24 |z| in p that the forward's log-sum-exp did not share (shift-variant).
    centred2 = centred_log2(acc, row_max[:, None], centred_scale)
    d_z = softmax_dz(
        centred2, log_sumexp[:, None], -coef[:, None], -g_ent[:, None], centred_mean[:, None], True
    )
    if SMOOTHING:
        d_z += uniform[:, None]
    d_logits = d_z * slope
    if BF16_INTERPRETED:
        # The interpreter truncates fp32 -> bf16; round to nearest as the GPU does.
        d_logits = round_bf16_rne(d_logits)
    # A pointer store: a TMA store of the tile measured 5-30% slower on an H200 (triton 3.6).
    out = dlogits_ptr + offs_t[:, None] * stride_dt + offs_v[None, :]
    tl.store(out, d_logits.to(dlogits_ptr.dtype.element_ty), mask=in_t[:, None] & in_v[None, :])


def dlogits_chunk(
    hidden: torch.Tensor,
    weight_chunk: torch.Tensor,
    bias_chunk: torch.Tensor | None,
    targets: torch.Tensor,
    chunk_start: int,
    logit: LogitOptions,
    rows: BackwardRows,
    target_values: torch.Tensor,
    out: torch.Tensor,
    config: TritonConfig,
) -> None:
    """Write d_logits of vocab rows ``weight_chunk`` (global ids from ``chunk_start``; their bias
    ``bias_chunk``, unit stride, or None) into ``out``, the target lanes from ``target_values``
    (`target_kernel.target_dlogits` of the shard).

    ``out`` is ``[T, C]`` with unit column stride; ``rows`` fp32 and contiguous, their ``d_z``
    coefficients already times ``logit.dlogit_scale`` (`stages._scaled`); ``targets`` int64
    contiguous.
    """
    num_tokens, chunk = hidden.shape[0], weight_chunk.shape[0]
    tiles = config.backward_tile(logit.softcap is not None).for_dtype(weight_chunk.dtype)
    grid = (triton.cdiv(num_tokens, tiles.block_t) * triton.cdiv(chunk, tiles.block_v),)
    _dlogits_kernel[grid](
        bias_ptr=bias_chunk, max_ptr=rows.max,
        log_sumexp_ptr=rows.log_sumexp, centred_mean_ptr=rows.centred_mean,
        softmax_coef_ptr=rows.softmax_coef, grad_entropy_ptr=rows.grad_entropy,
        target_grad_ptr=rows.target_grad, uniform_ptr=rows.uniform, dlogits_ptr=out,
        T=num_tokens, C=chunk, C_DIV16=chunk % 16 == 0, **map_args(logit, bias_chunk),
        stride_dt=out.stride(0),
        **operand_args(hidden, weight_chunk, tiles, config.use_tma),
        BLOCK_T=tiles.block_t, BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h, GROUP=tiles.group,
        PRECISION=config.fp32_precision, **tiles.launch_options(),
        # No FMA contraction: the epilogue must round as the forward's does (a fused
        # `(acc - max) * centred_scale - log_sumexp` would keep residuals the forward's sums lack;
        # on a confident row the entropy term weights them by p ~ 1 against a tiny E[z] - max).
        # The epilogue's few flops per logit are noise next to the tile's 2H-flop dot.
        enable_fp_fusion=False,
    )  # fmt: skip
    place_target_dlogits(out, targets, chunk_start, target_values)
