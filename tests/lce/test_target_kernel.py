"""The target lane apart from the logits tiles (`lce.backends.triton.target_kernel`): its dot is
the tiles' own, bit for bit, and a chunk's target lanes are written and nothing else. Runs
compiled on CUDA, else under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lce.backends.triton import TileShape, TritonConfig, TritonStages
from lce.backends.triton.target_kernel import (
    place_target_dlogits,
    target_dlogits,
    target_logits_into,
)
from lce.options import LogitOptions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Tiles smaller than the shapes (several vocab tiles and splits), as tests/lce/test_triton_stages.
TILE = TileShape(block_t=32, block_v=64, block_h=32, group=2, num_warps=4, num_stages=2)
SMALL = TritonConfig(forward=TILE, backward=TILE, tiles_per_program=2)


def _case(num_tokens, hidden_size, vocab, vocab_start, dtype, seed):
    """Gaussian rows with a common offset in every product (each partial sum carries it, so the
    summation order shows in the last bits) and targets inside, outside and ignored (-1)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen) + 3.0
    weight = torch.randn(vocab, hidden_size, generator=gen) * torch.rand(vocab, 1, generator=gen)
    targets = torch.randint(vocab_start - 9, vocab_start + vocab + 9, (num_tokens,), generator=gen)
    targets[::7] = -1
    return hidden.to(dtype), weight.to(dtype), targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hidden_size", "vocab_start"), [(77, 0), (128, 500), (5, 3)])
@pytest.mark.parametrize("mapped", [False, True], ids=["plain", "bias+softcap"])
def test_target_lane_is_the_tiles_lane_bit_for_bit(dtype, hidden_size, vocab_start, mapped):
    """Where a token's target is its row's largest logit, the target's raw unit equals the row
    max the logits tiles found, bit for bit (the same instructions in the same order; a summation
    order of its own differed by ulps there, and a confident row's log-prob, ``(r_y - max) -
    log1p(...)``, lost all relative precision). Every owned target is within the dots' fp32
    rounding of float64; a target outside the shard or ignored gives 0. H = 77 and 5: a partial
    last K step."""
    hidden, weight, targets = _case(40, hidden_size, 61, vocab_start, dtype, seed=hidden_size)
    bias = torch.randn(61, generator=torch.Generator().manual_seed(1)).to(dtype) if mapped else None
    logit = LogitOptions(softcap=2.5, logit_scale=0.5) if mapped else LogitOptions()
    raw = hidden.double() @ weight.double().T + (0 if bias is None else bias.double())
    argmax = raw.argmax(dim=1)
    targets[:20] = argmax[:20] + vocab_start  # half the rows: the target at the max
    on_device = [t.to(DEVICE) if t is not None else None for t in (hidden, weight, bias, targets)]
    stats = TritonStages(SMALL).forward_stats(*on_device, vocab_start, logit)
    out = torch.full((40,), 9.0, device=DEVICE)
    target_logits_into(*on_device, vocab_start, logit, SMALL, out)
    assert torch.equal(out, stats.target_logit)
    assert torch.equal(out[:20], stats.max[:20])
    local = targets - vocab_start
    owned = (local >= 0) & (local < 61)
    picked = raw.gather(1, local.clamp(0, 60)[:, None]).squeeze(1)
    if mapped:
        picked = torch.tanh(picked * logit.cap_scale)
    # H products and the bias add, each rounded at most at the fp32 size of the row's terms.
    bound = (
        (hidden_size + 2) * 2.0**-23 * ((hidden.abs().double() @ weight.abs().double().T).amax(1))
    )
    assert ((out.cpu().double() - torch.where(owned, picked, 0.0)).abs() <= bound).all()


def test_placed_target_lanes_are_the_only_writes():
    """A chunk of columns [40, 70) of a shard from 1000: tokens whose target lies there get their
    value (rounded once to bf16), every other element keeps its bits."""
    targets = torch.tensor([1045, 1039, 1070, -1, 1040, 1069, 5])
    values = torch.tensor([1.5, 2.0, 3.0, 4.0, -0.3333, 7.0, 8.0]).to(torch.bfloat16)
    out = torch.full((7, 30), -2.0, dtype=torch.bfloat16)
    want = out.clone()
    for row, column in ((0, 5), (4, 0), (5, 29)):
        want[row, column] = values[row]
    got = out.to(DEVICE)
    place_target_dlogits(got, targets.to(DEVICE), 1040, values.to(DEVICE))
    assert torch.equal(got.cpu(), want)


def test_target_dlogits_scale_by_the_lane_slope_and_keep_zero_rows_zero():
    """``target_grad * (1 - r)(1 + r)`` rounded once to weight's dtype (``target_grad`` already
    times ``dlogit_scale``), r the softcapped target unit; a row whose target_grad is 0 gets
    exactly +0."""
    hidden, weight, targets = _case(12, 40, 30, 0, torch.bfloat16, seed=3)
    logit = LogitOptions(softcap=3.0, temperature=0.7)
    target_grad = torch.randn(12, generator=torch.Generator().manual_seed(4))
    target_grad[2] = -0.0
    target_grad *= logit.dlogit_scale
    args = (hidden.to(DEVICE), weight.to(DEVICE), None, targets.to(DEVICE), 0, logit, SMALL)
    got = target_dlogits(*args, target_grad.to(DEVICE)).cpu()
    units = torch.empty(12, device=DEVICE)
    target_logits_into(*args, units)
    units = units.cpu()
    slope = (1.0 - units) * (1.0 + units)
    want = (target_grad * slope).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert got[2] == 0 and not torch.signbit(got[2].float())
