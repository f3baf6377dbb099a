"""verify.numerics.portable_math: exp/log/log1p within a few ulp of libm, exact where R relies
on it, and the same bits as recorded here (R's cross-machine reproducibility rests on them)."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from verify.numerics import portable_math

# sha256 (first 16 hex digits) of exp and log on `test_same_bits_as_recorded`'s grid.
EXP_SHA = "cc233171b39909dc"
LOG_SHA = "1a3b13e96be0131a"
# log1p's, recorded on the development machine only (log's operations plus one division).
LOG1P_SHA = "0139de4df8e26336"


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    spacing = torch.nextafter(want.abs(), torch.tensor(math.inf, dtype=torch.float64)) - want.abs()
    return (got - want).abs() / spacing


@pytest.mark.parametrize(
    "fn, libm, low, high, max_ulps",
    [
        # Bounds from 200k-point runs: exp <= 1 ulp, log <= 3 ulp near 1 (s = (m-1)/(m+1)
        # rounds once before the series), <= 2 elsewhere. A broken coefficient table or range
        # reduction is off by thousands of ulp.
        (portable_math.exp, math.exp, -745.0, -700.0, 1),
        (portable_math.exp, math.exp, -60.0, 60.0, 1),
        (portable_math.exp, math.exp, 700.0, 709.7, 1),
        (portable_math.log, math.log, 1e-300, 1e-290, 2),
        (portable_math.log, math.log, 0.5, 2.0, 3),
        (portable_math.log, math.log, 1.0, 1e6, 2),
        # log1p, 200k points: <= 1 ulp for tiny x, <= 3 in the series branch (s = x / (2 + x)
        # rounds twice), <= 4 where log(1 + x) takes over. Rounding 1 + x first is off by up to
        # 2^52 ulp at x = 1e-16 (R's confident rows).
        (portable_math.log1p, math.log1p, 1e-300, 1e-290, 1),
        (portable_math.log1p, math.log1p, 1e-20, 1e-10, 1),
        (portable_math.log1p, math.log1p, -0.29, 0.41, 3),
        (portable_math.log1p, math.log1p, -0.999, 1e6, 4),
    ],
)
def test_within_a_few_ulp_of_libm(fn, libm, low, high, max_ulps) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.rand(20000, generator=gen, dtype=torch.float64) * (high - low) + low
    want = torch.tensor([libm(v) for v in x.tolist()], dtype=torch.float64)
    assert _ulps(fn(x), want).max().item() <= max_ulps


def test_special_values() -> None:
    x = torch.tensor([0.0, 1.0, -math.inf, math.inf, math.nan, -800.0, 800.0], dtype=torch.float64)
    got = portable_math.exp(x)
    assert got[0].item() == 1.0 and got[2].item() == 0.0 and got[3].item() == math.inf
    assert math.isnan(got[4].item()) and got[5].item() == 0.0 and got[6].item() == math.inf
    y = torch.tensor([1.0, 0.0, -1.0, math.inf, math.nan, 5e-324], dtype=torch.float64)
    logs = portable_math.log(y)
    assert logs[0].item() == 0.0  # a one-lane row: log-prob exactly 0, as R promises
    assert logs[1].item() == -math.inf and math.isnan(logs[2].item())
    assert logs[3].item() == math.inf and math.isnan(logs[4].item())
    assert logs[5].item() == math.log(5e-324)  # subnormal input
    x = torch.tensor([0.0, 1e-300, -1.0, math.inf, math.nan, -2.0], dtype=torch.float64)
    log1ps = portable_math.log1p(x)
    assert log1ps[0].item() == 0.0 and log1ps[1].item() == 1e-300  # R's log_sumexp of one lane
    assert log1ps[2].item() == -math.inf and log1ps[3].item() == math.inf
    assert math.isnan(log1ps[4].item()) and math.isnan(log1ps[5].item())


def test_same_bits_as_recorded() -> None:
    """A grid built without rounding (integers / 64) and the sha256 of both functions on it, as
    computed on the development machine (AVX2, torch 2.13) and on an H100 host (AVX-512,
    torch 2.11). A machine that rounds any step differently changes every R built on it."""
    grid = torch.arange(-48000, 48000, dtype=torch.float64) / 64  # [-750, 750) in steps of 1/64
    exp_bits = portable_math.exp(grid).numpy().tobytes()
    log_bits = portable_math.log(grid[grid > 0]).numpy().tobytes()
    log1p_bits = portable_math.log1p(grid[grid > -1]).numpy().tobytes()
    assert hashlib.sha256(exp_bits).hexdigest()[:16] == EXP_SHA
    assert hashlib.sha256(log_bits).hexdigest()[:16] == LOG_SHA
    assert hashlib.sha256(log1p_bits).hexdigest()[:16] == LOG1P_SHA
