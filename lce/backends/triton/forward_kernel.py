"""Forward stage: vocab-split online softmax over logits tiles, then a merge of the splits.

Each program owns ``block_t`` tokens x ``tiles_per_program`` vocab tiles, maps each tile of raw
dots with `tiles.logit_map` and writes the fp32 partials of its split per token (`PARTIALS`);
`merge_partials` folds the splits. The target lane is not picked out of the tiles: its raw unit
comes from `target_kernel` (see there why).
"""

from __future__ import annotations

from dataclasses import fields

import torch
import triton
import triton.language as tl

from lce.backends.base import ShardStats
from lce.backends.triton.config import TritonConfig, interpreting
from lce.backends.triton.operands import map_args, operand_args
from lce.backends.triton.target_kernel import target_logits_into
from lce.backends.triton.tiles import (
    LN2,
    centred_log2,
    grouped_tile,
    logit_map,
    logits_tile,
    logits_tile_tma,
)
from lce.options import LogitOptions

# The per-split planes of `forward_partials`: the `ShardStats` fields but the target's.
PARTIALS = ("max", "sumexp_nonmax", "sumexp_z", "sum_centred")

INTERPRETER_PROGRAMS = 2
# The merge's tile: 32 tokens (one 128-byte line per split and plane) x 64 splits, so T / 32
# programs share the reads (see `merge_partials` for what fewer, longer programs cost).
MERGE_BLOCK_T, MERGE_BLOCK_S = 32, 64


@triton.jit
def _online_softmax_step(
    acc,
    num_cols,
    centred_scale,
    row_max,
    sumexp_nonmax,
    sumexp_z,
    sum_centred,
    seen_cols,
    BLOCK_V: tl.constexpr,
    MASKED: tl.constexpr,
    SMOOTHING: tl.constexpr,
):
    """Fold one ``[BLOCK_T, BLOCK_V]`` tile of raw units (`tiles.logit_map`) into the running
    statistics.

    ``num_cols``: the tile's real columns, read only when ``MASKED`` (the tile overhangs V);
    ``seen_cols``: the columns folded before this tile, whose centred sum (``SMOOTHING`` only)
    moves by the shift of the max.
    """
    if MASKED:
        in_v = tl.arange(0, BLOCK_V)[None, :] < num_cols
        acc = tl.where(in_v, acc, float("-inf"))
    # The running max stays in raw units and each lane is centred before the scale: the max
    # lane's centred value is then exactly 0 even where the compiler contracts
    # `acc * centred_scale - max` into one FMA (which leaves the product's rounding residual,
    # ~2^-24 |z|; weighted by p ~ 1 on a confident row it swamped E[z] - max, measured 6e-4
    # relative in the entropy gradient on an H100).
    tile_max = tl.max(acc, axis=1)
    new_max = tl.maximum(row_max, tile_max)
    # Every tile holds >= 1 real column, so new_max is finite for finite logits; the guards
    # keep -inf rows (empty history) from producing inf - inf.
    seen = row_max > float("-inf")
    shift = tl.where(seen, (row_max - new_max) * centred_scale, 0.0)
    scale = tl.where(seen, tl.exp(shift), 0.0)
    # Lanes in log2 units: one multiply and exp2 per lane (tl.exp multiplies by log2(e) again).
    centred2 = centred_log2(acc, new_max[:, None], centred_scale)
    if MASKED:
        centred2 = tl.where(in_v, centred2, 0.0)
    e = tl.exp2(centred2)
    if MASKED:
        e = tl.where(in_v, e, 0.0)
    # Non-max terms, never 1 + small: lanes at the max (e = 1 exactly) are left out of the sum
    # and counted. Where the tile takes the max (ties included) one of them stays out, the
    # others add their exact 1 and the running max lane's 1 joins rescaled; a tile below the
    # max has no lane at it. No index reduction: a max alone is faster than an argmax.
    takes = tile_max >= row_max
    tile_nonmax = tl.sum(tl.where(acc == new_max[:, None], 0.0, e), axis=1)
    # The count from a plain sum (one add per lane, no select): the two sums of BLOCK_V terms in
    # [0, 1] are each within BLOCK_V^2 * 2^-24 of exact (<= 1/16), so rounding gives it exactly.
    tl.static_assert(BLOCK_V <= 1024, "the max-lane count needs BLOCK_V <= 1024")
    max_lanes = tl.floor(tl.sum(e, axis=1) - tile_nonmax + 0.5)
    tile_z = LN2 * tl.sum(e * centred2, axis=1)
    sumexp_z = scale * (sumexp_z + shift * (1.0 + sumexp_nonmax)) + tile_z
    sumexp_nonmax = scale * sumexp_nonmax + tile_nonmax
    sumexp_nonmax += tl.where(takes, scale + (max_lanes - 1.0), 0.0)
    if SMOOTHING:  # sum_j (z_j - new max) over the columns seen; masked lanes' centred2 is 0
        sum_centred = sum_centred + seen_cols * shift + LN2 * tl.sum(centred2, axis=1)
    return new_max, sumexp_nonmax, sumexp_z, sum_centred


# Triton compiles once per combination of each int argument's class (== 1, divisible by 16, other)
# and each pointer's 16-byte alignment: a GPU campaign's small shapes meet every class. Kept where
# the machine code needs it: H and the operands' strides and alignment (the matmul's pointer
# loads), tiles_per_split (1 on the GPU config; a runtime count spilled registers and cost 2.7% of
# the forward at llama3-8k on an H200) and V's divisibility by 16 alone (V_DIV16: V sizes the
# masked last tile). T, the offsets, the split and program counts and the targets' alignment only
# bound the item loop or address the per-token epilogue: unspecialized, the
# sm_90 code at production shapes is identical or a few instructions longer and no slower
# (benchmarks/specialization_codegen.py, docs/NIGHTLY.md). Fully unspecialized: 6-7% slower.
@triton.jit(
    do_not_specialize=["T", "V", "num_splits", "num_programs", "plane"],
)  # fmt: skip
def _forward_partials_kernel(
    hidden,
    weight,
    bias_ptr,
    partials_ptr,
    T,
    V,
    H,
    centred_scale,
    cap_scale,
    num_splits,
    tiles_per_split,
    num_programs,
    plane,
    stride_ht,
    stride_hh,
    stride_wv,
    stride_wh,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN_H: tl.constexpr,
    BF16_INTERPRETED: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    V_DIV16: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SMOOTHING: tl.constexpr,
):
    if V_DIV16:  # the shifts tell the compiler what the launcher knows (a no-op on V's value)
        V = (V >> 4) << 4
    num_token_tiles = tl.cdiv(T, BLOCK_T)
    # Persistent when launched with fewer programs than items: each program walks the (token
    # tile, split) items; warp-specialized, its loads for the next item overlap this epilogue.
    for item in tl.range(
        tl.program_id(0), num_token_tiles * num_splits, num_programs,
        warp_specialize=WARP_SPECIALIZE,
    ):  # fmt: skip
        pid_t, pid_s = grouped_tile(item, num_token_tiles, num_splits, GROUP)
        offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        in_t = offs_t < T
        rows = offs_t % T

        row_max = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)  # raw units
        sumexp_nonmax = tl.zeros((BLOCK_T,), dtype=tl.float32)  # one max lane's 1 left out
        sumexp_z = tl.zeros((BLOCK_T,), dtype=tl.float32)  # sum exp(z - max z) * (z - max z)
        sum_centred = tl.zeros((BLOCK_T,), dtype=tl.float32)  # sum (z - max z), smoothing only

        first_tile = pid_s * tiles_per_split
        num_tiles = min(tiles_per_split, tl.cdiv(V, BLOCK_V) - first_tile)
        for i in range(0, num_tiles):
            tile_start = (first_tile + i) * BLOCK_V
            offs_v = tile_start.to(tl.int64) + tl.arange(0, BLOCK_V)
            if USE_TMA:
                acc = logits_tile_tma(
                    hidden, weight, pid_t * BLOCK_T, tile_start, H,
                    BLOCK_T, BLOCK_V, BLOCK_H, BF16_INTERPRETED, PRECISION,
                )  # fmt: skip
            else:
                acc = logits_tile(
                    hidden, weight, rows, offs_v % V, H,
                    stride_ht, stride_hh, stride_wv, stride_wh,
                    BLOCK_T, BLOCK_V, BLOCK_H, EVEN_H, BF16_INTERPRETED, PRECISION,
                )  # fmt: skip
            bias = None
            if HAS_BIAS:
                bias = tl.load(bias_ptr + offs_v, mask=offs_v < V, other=0.0).to(tl.float32)
                bias = bias[None, :]
            acc, _ = logit_map(acc, bias, cap_scale, HAS_BIAS, SOFTCAP)
            seen_cols = i * BLOCK_V  # every tile before this one is whole
            if tile_start + BLOCK_V <= V:  # every tile but a shard's last: no padded columns
                row_max, sumexp_nonmax, sumexp_z, sum_centred = _online_softmax_step(
                    acc, V - tile_start, centred_scale,
                    row_max, sumexp_nonmax, sumexp_z, sum_centred, seen_cols,
                    BLOCK_V, False, SMOOTHING,
                )  # fmt: skip
            else:
                row_max, sumexp_nonmax, sumexp_z, sum_centred = _online_softmax_step(
                    acc, V - tile_start, centred_scale,
                    row_max, sumexp_nonmax, sumexp_z, sum_centred, seen_cols,
                    BLOCK_V, True, SMOOTHING,
                )  # fmt: skip

        out = partials_ptr + pid_s.to(tl.int64) * T + offs_t
        tl.store(out, row_max, mask=in_t)  # raw units: the backward centres lanes on it
        out += plane  # plane = splits * T; stepping by it keeps every offset in range
        tl.store(out, sumexp_nonmax, mask=in_t)
        out += plane
        tl.store(out, sumexp_z, mask=in_t)
        out += plane
        tl.store(out, sum_centred, mask=in_t)


@triton.jit(do_not_specialize=["num_splits", "V"])  # loop and column counts
def _merge_partials_kernel(
    partials_ptr,
    out_ptr,
    T,
    V,
    num_splits,
    split_cols,
    plane,
    centred_scale,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SMOOTHING: tl.constexpr,
):
    """Per token: the (raw) max over splits, then each split's sums rescaled onto it and added (the
    non-max terms as in `lce.tp.merge_stats`: one split at the max keeps its 1 out). A split holds
    ``split_cols`` columns (the last one the rest of ``V``), which re-centre its ``sum_centred``.

    Each step reads a ``[BLOCK_S splits, BLOCK_T tokens]`` tile (tokens contiguous) and reduces
    over the splits."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = offs_t < T
    splits = tl.arange(0, BLOCK_S)
    row_max = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    for first in range(0, num_splits, BLOCK_S):
        at, mask = _split_tile(partials_ptr, first + splits, offs_t, T, num_splits, in_t)
        tile_max = tl.max(tl.load(at, mask=mask, other=float("-inf")), axis=0)
        row_max = tl.maximum(row_max, tile_max)
    sumexp_nonmax = tl.zeros((BLOCK_T,), dtype=tl.float32)
    max_holders = tl.zeros((BLOCK_T,), dtype=tl.float32)
    sumexp_z = tl.zeros((BLOCK_T,), dtype=tl.float32)
    sum_centred = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for first in range(0, num_splits, BLOCK_S):
        split = first + splits
        at, mask = _split_tile(partials_ptr, split, offs_t, T, num_splits, in_t)
        split_max = tl.load(at, mask=mask, other=float("-inf"))
        # A split with no finite logit (max -inf) adds exactly 0.
        seen = split_max > float("-inf")
        # Raw maxima subtracted before the scale, as each lane was centred; no inf - inf.
        top = tl.where(seen, row_max[None, :], 0.0)
        shift = tl.where(seen, (split_max - top) * centred_scale, 0.0)
        scale = tl.where(seen, tl.exp(shift), 0.0)
        holds_max = seen & (split_max == row_max[None, :])
        split_nonmax = tl.load(at + plane, mask=mask, other=0.0)
        nonmax = scale * split_nonmax + tl.where(holds_max, 0.0, scale)
        sumexp_nonmax += tl.sum(nonmax, axis=0)
        max_holders += tl.sum(holds_max.to(tl.float32), axis=0)
        split_sumexp = tl.where(seen, 1.0 + split_nonmax, 0.0)
        split_z = tl.load(at + 2 * plane, mask=mask, other=0.0)
        sumexp_z += tl.sum(scale * (split_z + shift * split_sumexp), axis=0)
        if SMOOTHING:
            cols = tl.minimum(split_cols, V - split * split_cols).to(tl.float32)
            split_sum = tl.load(at + 3 * plane, mask=mask, other=0.0)
            sum_centred += tl.sum(tl.where(seen, split_sum + cols[:, None] * shift, 0.0), axis=0)
    tl.store(out_ptr + offs_t, row_max, mask=in_t)
    tl.store(out_ptr + T + offs_t, sumexp_nonmax + (max_holders - 1.0), mask=in_t)
    tl.store(out_ptr + 2 * T + offs_t, sumexp_z, mask=in_t)
    tl.store(out_ptr + 4 * T + offs_t, sum_centred, mask=in_t)  # ShardStats' plane 3: the target


@triton.jit
def _split_tile(partials_ptr, split, offs_t, T, num_splits, in_t):
    """Pointers to the first plane's ``[splits, tokens]`` tile and its mask (real split, token)."""
    at = partials_ptr + split.to(tl.int64)[:, None] * T + offs_t[None, :]
    return at, (split < num_splits)[:, None] & in_t[None, :]


def shard_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    vocab_start: int,
    logit: LogitOptions,
    config: TritonConfig,
) -> ShardStats:
    """The shard's `ShardStats`: `forward_partials`, `merge_partials`, and the target lane's raw
    unit (`target_kernel.target_logits_into`). Needs T, V >= 1, contiguous int64 ``targets``
    (global ids, -1 ignored) and a contiguous ``bias`` or None."""
    partials, split_cols = forward_partials(hidden, weight, bias, logit, config)
    merged = torch.empty(
        len(fields(ShardStats)), hidden.shape[0], dtype=torch.float32, device=hidden.device
    )
    merge_partials(partials, logit, weight.shape[0], split_cols, merged)
    target_logits_into(hidden, weight, bias, targets, vocab_start, logit, config, merged[3])
    return ShardStats(*merged.unbind(0))


def merge_partials(
    partials: torch.Tensor,
    logit: LogitOptions,
    vocab_local: int,
    split_cols: int,
    out: torch.Tensor,
) -> None:
    """Fold ``[4, splits, T]`` per-split partials (`PARTIALS`) into fp32 ``out [5, T]``
    (contiguous, `ShardStats` order), every field but ``target_logit`` (left as it was); each
    split holds ``split_cols`` of the shard's ``vocab_local`` columns (the last the rest).

    One kernel, two reads of the partials: 0.06 / 0.13 / 0.11 ms at llama3-8k / qwen2.5-16k /
    gemma2-8k on an H100 (torch ops took ~0.3 ms at llama3-8k; a program per 512 tokens 0.55).
    """
    _, num_splits, num_tokens = partials.shape
    _merge_partials_kernel[(triton.cdiv(num_tokens, MERGE_BLOCK_T),)](
        partials, out, num_tokens, vocab_local, num_splits, split_cols,
        num_splits * num_tokens, logit.centred_scale, BLOCK_T=MERGE_BLOCK_T, BLOCK_S=MERGE_BLOCK_S,
        SMOOTHING=logit.label_smoothing > 0, num_warps=4,
    )  # fmt: skip


def forward_partials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    logit: LogitOptions,
    config: TritonConfig,
) -> tuple[torch.Tensor, int]:
    """fp32 ``[4, splits, T]`` partial statistics (`PARTIALS`) and the columns each split holds
    (`merge_partials`); needs T, V >= 1, a contiguous ``bias`` or None."""
    num_tokens, vocab_local = hidden.shape[0], weight.shape[0]
    tiles = config.forward.for_dtype(weight.dtype)
    num_vocab_tiles = triton.cdiv(vocab_local, tiles.block_v)
    tiles_per_split = min(config.tiles_per_program, num_vocab_tiles)
    num_splits = triton.cdiv(num_vocab_tiles, tiles_per_split)
    partials = torch.empty(
        len(PARTIALS), num_splits, num_tokens, dtype=torch.float32, device=hidden.device
    )
    num_items = triton.cdiv(num_tokens, tiles.block_t) * num_splits
    programs = num_items
    if config.persistent:
        programs = min(num_items, _persistent_programs(hidden.device))
    operands = operand_args(hidden, weight, tiles, config.use_tma)
    _forward_partials_kernel[(programs,)](
        bias_ptr=bias, partials_ptr=partials,
        T=num_tokens, V=vocab_local, V_DIV16=vocab_local % 16 == 0,
        num_splits=num_splits, tiles_per_split=tiles_per_split,
        num_programs=programs, plane=num_splits * num_tokens, **operands,
        BLOCK_T=tiles.block_t, BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h, GROUP=tiles.group,
        PRECISION=config.fp32_precision, **tiles.launch_options(),
        WARP_SPECIALIZE=warp_specialized(config, operands["USE_TMA"]), **map_args(logit, bias),
    )  # fmt: skip
    return partials, tiles_per_split * tiles.block_v


def warp_specialized(config: TritonConfig, tma: bool) -> bool:
    """Whether the forward is compiled warp-specialized: persistent, TMA loads (the specialized
    loader issues descriptor loads), and compiled rather than interpreted."""
    return config.persistent and tma and not interpreting()


def _persistent_programs(device: torch.device) -> int:
    """One program per SM; two under the interpreter, so each walks several items there too."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count
