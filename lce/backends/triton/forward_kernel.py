"""Forward stage: vocab-split online softmax over logits tiles, then a merge of the splits.

Each program owns ``block_t`` tokens x ``tiles_per_program`` vocab tiles and writes the fp32
`ShardStats` partials of its split per token; `merge_partials` folds the splits.
"""

from __future__ import annotations

from dataclasses import fields

import torch
import triton
import triton.language as tl

from lce.backends.base import ShardStats
from lce.backends.triton.config import TritonConfig
from lce.backends.triton.operands import operand_args
from lce.backends.triton.tiles import grouped_tile, logits_tile, logits_tile_tma


@triton.jit
def _forward_partials_kernel(
    hidden,
    weight,
    targets_ptr,
    partials_ptr,
    T,
    V,
    H,
    vocab_start,
    inv_temp,
    num_splits,
    tiles_per_split,
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
):
    pid_t, pid_s = grouped_tile(tl.program_id(0), tl.cdiv(T, BLOCK_T), num_splits, GROUP)
    offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = offs_t < T
    rows = offs_t % T
    local_target = tl.load(targets_ptr + rows) - vocab_start  # -1 (ignored) matches no column

    row_max = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)  # of acc = z * T
    sumexp = tl.zeros((BLOCK_T,), dtype=tl.float32)
    sumexp_z = tl.zeros((BLOCK_T,), dtype=tl.float32)  # sum exp(z - max z) * (z - max z)
    target_acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    sumexp_others = tl.zeros((BLOCK_T,), dtype=tl.float32)  # the target lane left out

    first_tile = pid_s * tiles_per_split
    num_tiles = min(tiles_per_split, tl.cdiv(V, BLOCK_V) - first_tile)
    for i in range(0, num_tiles):
        offs_v = (first_tile + i).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        in_v = offs_v < V
        if USE_TMA:
            acc = logits_tile_tma(
                hidden, weight, pid_t * BLOCK_T, (first_tile + i) * BLOCK_V, H,
                BLOCK_T, BLOCK_V, BLOCK_H, BF16_INTERPRETED, PRECISION,
            )  # fmt: skip
        else:
            acc = logits_tile(
                hidden, weight, rows, offs_v % V, H, stride_ht, stride_hh, stride_wv, stride_wh,
                BLOCK_T, BLOCK_V, BLOCK_H, EVEN_H, BF16_INTERPRETED, PRECISION,
            )  # fmt: skip
        # The running max stays in raw dot units and each lane is centred before the 1/T scale:
        # the max lane's centred value is then exactly 0 even where the compiler contracts
        # `acc * inv_temp - max` into one FMA (which leaves the product's rounding residual,
        # ~2^-24 |z|; weighted by p ~ 1 on a confident row it swamped E[z] - max, measured 6e-4
        # relative in the entropy gradient on an H100).
        is_target = (offs_v[None, :] == local_target[:, None]) & in_v[None, :]
        target_acc += tl.sum(tl.where(is_target, acc, 0.0), axis=1)
        acc = tl.where(in_v[None, :], acc, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(acc, axis=1))
        # Every tile holds >= 1 real column, so new_max is finite for finite logits; the guards
        # keep -inf rows (empty history) from producing inf - inf.
        seen = row_max > float("-inf")
        shift = tl.where(seen, (row_max - new_max) * inv_temp, 0.0)
        scale = tl.where(seen, tl.exp(shift), 0.0)
        centred = tl.where(in_v[None, :], (acc - new_max[:, None]) * inv_temp, 0.0)
        e = tl.where(in_v[None, :], tl.exp(centred), 0.0)
        sumexp_z = scale * (sumexp_z + shift * sumexp) + tl.sum(e * centred, axis=1)
        sumexp = scale * sumexp + tl.sum(e, axis=1)
        sumexp_others = scale * sumexp_others + tl.sum(tl.where(is_target, 0.0, e), axis=1)
        row_max = new_max

    out = partials_ptr + pid_s.to(tl.int64) * T + offs_t
    tl.store(out, row_max * inv_temp, mask=in_t)  # max z, the same rounding as target_logit's
    out += plane  # plane = splits * T; stepping by it keeps every offset in range
    tl.store(out, sumexp, mask=in_t)
    out += plane
    tl.store(out, sumexp_z, mask=in_t)
    out += plane
    tl.store(out, target_acc * inv_temp, mask=in_t)
    out += plane
    tl.store(out, sumexp_others, mask=in_t)


def merge_partials(partials: torch.Tensor) -> ShardStats:
    """Fold ``[5, splits, T]`` per-split partials (`ShardStats` order) into one `ShardStats`."""
    split_max, split_sumexp, split_sumexp_z, split_target, split_others = partials.unbind(0)
    row_max = split_max.amax(dim=0)
    seen = split_max > float("-inf")
    shift = torch.where(seen, split_max - row_max, torch.zeros_like(split_max))
    scale = torch.where(seen, torch.exp(shift), torch.zeros_like(split_max))
    return ShardStats(
        max=row_max,
        sumexp=(scale * split_sumexp).sum(dim=0),
        sumexp_z=(scale * (split_sumexp_z + shift * split_sumexp)).sum(dim=0),
        target_logit=split_target.sum(dim=0),
        sumexp_others=(scale * split_others).sum(dim=0),
    )


def forward_partials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    temperature: float,
    config: TritonConfig,
) -> torch.Tensor:
    """fp32 ``[5, splits, T]`` partial statistics; needs T >= 1 and V >= 1."""
    (num_tokens, hidden_size), vocab_local = hidden.shape, weight.shape[0]
    tiles = config.forward.for_dtype(weight.dtype)
    num_vocab_tiles = triton.cdiv(vocab_local, tiles.block_v)
    tiles_per_split = min(config.tiles_per_program, num_vocab_tiles)
    num_splits = triton.cdiv(num_vocab_tiles, tiles_per_split)
    partials = torch.empty(
        len(fields(ShardStats)), num_splits, num_tokens, dtype=torch.float32, device=hidden.device
    )
    grid = (triton.cdiv(num_tokens, tiles.block_t) * num_splits,)
    _forward_partials_kernel[grid](
        targets_ptr=targets, partials_ptr=partials,
        T=num_tokens, V=vocab_local, H=hidden_size, vocab_start=vocab_start,
        inv_temp=1.0 / temperature, num_splits=num_splits, tiles_per_split=tiles_per_split,
        plane=num_splits * num_tokens,
        **operand_args(hidden, weight, tiles, config.use_tma),
        BLOCK_T=tiles.block_t, BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h, GROUP=tiles.group,
        PRECISION=config.fp32_precision, **tiles.launch_options(),
    )  # fmt: skip
    return partials
