"""The target lane, apart from the logits tiles: its raw unit by a gather dot (the forward's
``target_logit``), and its d_logits placed into a chunk the tiled backward wrote without it.

A tile kernel that picks the target lane out of every logits tile compares each lane's column
with its row's target: on sm_90 that took a third of the forward's instructions (the compares of
a whole tile came first, their predicates packed into registers and unpacked for the selects),
for one lane per row. Here each token's dot with its target's weight row is formed again, by the
tiles' own instructions in their order: the same bits, so a target at the row max is exactly the
max (`ShardStats`: a confident row's log-prob keeps its relative precision).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lce.backends.triton.config import TritonConfig, interpreting
from lce.backends.triton.tiles import logit_map, logits_tile
from lce.options import LogitOptions

# Tokens per program: a 64 x 64 tile, so the compiled kernel's dots take the same tensor-core
# instruction (wgmma) as the tiles' 128 x 256.
BLOCK_T = 64
PLACE_BLOCK_T = 128


@triton.jit
def target_units(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    local_target,
    owned,
    rows,
    H,
    cap_scale,
    stride_ht,
    stride_hh,
    stride_wv,
    stride_wh,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr,
    BF16_INTERPRETED: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Raw units ``r`` (`tiles.logit_map`) of ``hidden[rows] . weight[local_target]`` where
    ``owned``, else 0: the diagonal of a `tiles.logits_tile` of the rows against their targets'
    weight rows, so each dot is summed by the same instructions in the same order as in the
    logits tiles (``BLOCK_H`` and ``PRECISION`` as theirs), bit for bit the tiles' lane."""
    cols = tl.where(owned, local_target, 0).to(tl.int64)
    tile = logits_tile(
        hidden_ptr, weight_ptr, rows.to(tl.int64), cols, H, stride_ht, stride_hh, stride_wv,
        stride_wh, BLOCK_T, BLOCK_T, BLOCK_H, EVEN_H, BF16_INTERPRETED, PRECISION,
    )  # fmt: skip
    lanes = tl.arange(0, BLOCK_T)
    dots = tl.sum(tl.where(lanes[:, None] == lanes[None, :], tile, 0.0), axis=1)
    bias = None
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=owned, other=0.0).to(tl.float32)
    units, _ = logit_map(dots, bias, cap_scale, HAS_BIAS, SOFTCAP)
    return tl.where(owned, units, 0.0)


# One compile serves every T, V, H and row stride (the K loop always masks its tail, the per-token
# pointers are scalar loads): the dots are T x H products, a small share of any call. Only the
# operands' unit strides and alignment and the constexprs key it.
@triton.jit(
    do_not_specialize=["T", "V", "H", "vocab_start", "stride_ht", "stride_wv"],
    do_not_specialize_on_alignment=["bias_ptr", "targets_ptr", "out_ptr"],
)  # fmt: skip
def _target_logits_kernel(
    hidden,
    weight,
    bias_ptr,
    targets_ptr,
    out_ptr,
    T,
    V,
    H,
    vocab_start,
    cap_scale,
    stride_ht,
    stride_hh,
    stride_wv,
    stride_wh,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BF16_INTERPRETED: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = offs_t < T
    rows = offs_t % T  # padded lanes repeat a valid row
    local_target = tl.load(targets_ptr + rows) - vocab_start
    owned = in_t & (local_target >= 0) & (local_target < V)
    units = target_units(
        hidden, weight, bias_ptr, local_target, owned, rows, H, cap_scale,
        stride_ht, stride_hh, stride_wv, stride_wh,
        BLOCK_T, BLOCK_H, False, BF16_INTERPRETED, PRECISION, HAS_BIAS, SOFTCAP,
    )  # fmt: skip
    tl.store(out_ptr + offs_t, units, mask=in_t)


def target_logits_into(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    vocab_start: int,
    logit: LogitOptions,
    config: TritonConfig,
    out: torch.Tensor,
) -> None:
    """``out[t]`` (fp32 ``[T]``, unit stride) = the target lane's raw unit ``r_y`` (`ShardStats`)
    as the forward's tiles (``config.forward``) form it, where this shard holds token t's global
    target (int64 ``targets``, contiguous; -1 held by none), else 0. ``bias``: contiguous
    ``[V_local]`` or None."""
    num_tokens, hidden_size = hidden.shape
    if num_tokens == 0:
        return
    block_h = config.forward.for_dtype(weight.dtype).block_h
    _target_logits_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        hidden, weight, bias, targets, out, num_tokens, weight.shape[0], hidden_size,
        vocab_start, logit.cap_scale, *hidden.stride(), *weight.stride(),
        BLOCK_T=BLOCK_T, BLOCK_H=block_h, PRECISION=config.fp32_precision,
        BF16_INTERPRETED=interpreting() and weight.dtype == torch.bfloat16,
        HAS_BIAS=bias is not None, SOFTCAP=logit.softcap is not None, num_warps=4,
    )  # fmt: skip


def target_dlogits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    vocab_start: int,
    logit: LogitOptions,
    config: TritonConfig,
    target_grad: torch.Tensor,
) -> torch.Tensor:
    """Each token's target-lane d_logits in weight's dtype, ``[T]``: ``target_grad * slope``
    rounded once (``target_grad`` as `BackwardRows` has it, times ``logit.dlogit_scale``; the
    softcap's slope ``(1 - r)(1 + r)`` from the lane's raw unit, `target_logits_into`), 0 where
    ``target_grad`` is 0 (an ignored row's d_logits are exactly 0, as the tiles' are). Tokens
    whose target this shard does not hold get a value no chunk places."""
    slope: float | torch.Tensor = 1.0
    if logit.softcap is not None:
        units = torch.empty_like(target_grad)
        target_logits_into(hidden, weight, bias, targets, vocab_start, logit, config, units)
        slope = (1.0 - units) * (1.0 + units)
    values = torch.where(target_grad != 0, target_grad * slope, 0.0)
    return values.to(weight.dtype)


# One element stored per token: nothing to vectorize, so one compile per dtype.
@triton.jit(
    do_not_specialize=["T", "C", "chunk_start", "stride_dt"],
    do_not_specialize_on_alignment=["targets_ptr", "values_ptr", "dlogits_ptr"],
)  # fmt: skip
def _place_target_kernel(
    targets_ptr,
    values_ptr,
    dlogits_ptr,
    T,
    C,
    chunk_start,
    stride_dt,
    BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = rows < T
    column = tl.load(targets_ptr + rows, mask=in_t, other=-1) - chunk_start
    owned = in_t & (column >= 0) & (column < C)
    value = tl.load(values_ptr + rows, mask=owned)
    tl.store(dlogits_ptr + rows.to(tl.int64) * stride_dt + column, value, mask=owned)


def place_target_dlogits(
    out: torch.Tensor, targets: torch.Tensor, chunk_start: int, values: torch.Tensor
) -> None:
    """``out[t, y_t - chunk_start] = values[t]`` where global target ``y_t`` (int64 ``targets``)
    lies in the chunk's columns ``[chunk_start, chunk_start + C)`` of ``out [T, C]`` (unit column
    stride; ``values`` `target_dlogits`, contiguous); nothing else is written."""
    num_tokens = out.shape[0]
    if num_tokens == 0:
        return
    _place_target_kernel[(triton.cdiv(num_tokens, PLACE_BLOCK_T),)](
        targets, values, out, num_tokens, out.shape[1], chunk_start, out.stride(0),
        BLOCK_T=PLACE_BLOCK_T, num_warps=4,
    )  # fmt: skip
