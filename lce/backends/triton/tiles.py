"""Triton helpers shared by the forward and backward kernels: tile scheduling and one logits tile.

Everything here is ``@triton.jit`` device code; the torch-side launchers live in the kernel modules.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
