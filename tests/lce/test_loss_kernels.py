"""The 3-GEMM loss's row-statistics kernel (`lce.backends.triton.loss_kernels.row_stats_into`) on
vocabularies of several tiles: whole tiles only, whole tiles and a masked tail, one partial tile;
against float64 on the same bf16 logits."""

from __future__ import annotations

import pytest
import torch

from lce.backends.triton.loss_kernels import BLOCK_V_INTERPRETED, row_stats_into
from lce.options import LogitOptions

TEMPERATURE = 0.7
# fp32 sums of at most ~900 terms, each exp within a few ulp of float64's: relative errors stay
# near 1e-6. 1e-5 leaves a margin yet fails a lost or doubled term (>= 1e-3 of these sums) and
# the 1 + tiny cancellation a confident row would suffer (its non-max sum is ~1e-11 of 1).
RTOL = 1e-5
# Plus each term's exponent's conditioning: the kernel forms c = (z - max) / T in log2 units
# through up to four fp32 roundings of ~|c| (1 / T, log2 e, their product with z - max, a lane's
# shift to the row max), each moving exp(c) by u |c| relatively. The confident row's terms sit
# at c ~ -73..-99: 1.47e-5 of its sum on an H100 (compiled, one 2048-lane tile), within
# 4 u |c| = 1.7e-5, where the interpreter's numpy exp stayed under 1e-5.
EXPONENT_ROUNDINGS = 4
FP32_U = 2.0**-24


def _logits(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen) * 3.0
    logits[1, 5] = 60.0  # confident: every other term below exp(-60 / 0.7 + 9 / 0.7)
    if vocab > BLOCK_V_INTERPRETED + 5:
        # ties at the row max in two lanes, and two in one lane one tile apart
        logits[2, [3, vocab - 2]] = 40.0
        logits[3, [7, 7 + BLOCK_V_INTERPRETED]] = 40.0
    return logits.bfloat16()


def _reference(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 `ShardStats` (max, sumexp_nonmax, sumexp_z, target_logit) as ``[4, rows]``, and
    each row's relative tolerance for the two sums (`RTOL` and the exponents' conditioning: the
    sum's terms' mean |c|, weighted by the terms)."""
    a = logits.double()
    row_max, first_max = a.max(dim=1)
    centred = (a - row_max[:, None]) / TEMPERATURE
    terms = centred.exp()
    terms[torch.arange(a.shape[0]), first_max] = 0.0  # one max lane's 1 kept apart
    local = targets - vocab_start
    owned = (local >= 0) & (local < a.shape[1])
    picked = a.gather(1, local.clamp(0, a.shape[1] - 1)[:, None]).squeeze(1)
    target = torch.where(owned, picked, torch.zeros_like(picked))
    conditioning = (terms * centred.abs()).sum(1) / terms.sum(1).clamp_min(1e-300)
    rtol = RTOL + EXPONENT_ROUNDINGS * FP32_U * conditioning
    stats = torch.stack([row_max, terms.sum(1), (centred.exp() * centred).sum(1), target])
    return stats, rtol


@pytest.mark.parametrize(
    "vocab",
    [3 * BLOCK_V_INTERPRETED, 3 * BLOCK_V_INTERPRETED + 77, BLOCK_V_INTERPRETED - 29],
    ids=["whole-tiles", "tiles-and-tail", "one-partial-tile"],
)
def test_row_statistics_match_float64(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    rows, vocab_start = 6, 1000
    logits = _logits(rows, vocab, gen)
    # in the shard (first, last and inner columns), ignored (-1), and held by another shard
    targets = torch.tensor([vocab_start, vocab_start + vocab - 1, 5 + vocab_start, -1,
                            vocab_start + vocab, 3])  # fmt: skip
    # Compiled on a CUDA host (the suite's conftest interprets only without one), which needs
    # device tensors.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.full((5, rows), float("nan"), device=device)
    logit = LogitOptions(temperature=TEMPERATURE)
    row_stats_into(logits.to(device), None, targets.to(device), vocab_start, logit, out)
    out = out.cpu()
    ref, rtol = _reference(logits, targets, vocab_start)
    assert torch.equal(out[0].double(), ref[0])  # the max of bf16 values, exact
    assert torch.equal(out[3].double(), ref[3])  # one loaded logit, exact
    for field in (1, 2):  # the non-max sum, the centred sum
        error = (out[field].double() - ref[field]).abs()
        assert bool((error <= rtol * ref[field].abs()).all()), (field, error / ref[field].abs())
    assert out[1, 1] < 1e-10  # the confident row's non-max sum, never 1 + tiny - 1
