"""The Triton kernels' tanh (`lce.backends.triton.tiles.tanh_and_slope`): the interpreter has no
libdevice, so one formula serves both modes, and it must be as good as a library tanh."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402 (after the skip)

from lce.backends.triton.tiles import tanh_and_slope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _kernel(x_ptr, t_ptr, slope_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    t, slope = tanh_and_slope(tl.load(x_ptr + offs))
    tl.store(t_ptr + offs, t)
    tl.store(slope_ptr + offs, slope)


def test_tanh_and_its_slope_are_accurate_on_every_range():
    """Against float64: tanh within 4 ulps relative on every range (tiny, around the branch at
    0.625, saturated), and the slope 1 - tanh^2 within 1e-6 (+ |2x| u) relative even where tanh
    rounds to 1 (there ``1 - t*t`` from the rounded t would be 0, or off by up to 100%)."""
    ranges = [(1e-30, 1e-6), (1e-6, 0.6), (0.6, 0.65), (0.65, 40.0)]  # 2 x 4 x 256: a power of 2
    x = torch.cat([torch.linspace(lo, hi, 256, dtype=torch.float64) for lo, hi in ranges])
    x = torch.cat([x, -x]).float()
    t, slope = torch.empty_like(x, device=DEVICE), torch.empty_like(x, device=DEVICE)
    _kernel[(1,)](x.to(DEVICE), t, slope, N=x.numel())
    exact = torch.tanh(x.double())
    err_ulps = (t.cpu().double() - exact).abs() / (torch.finfo(torch.float32).eps * exact.abs())
    assert err_ulps.max().item() <= 4, err_ulps.max().item()
    exact_slope = 1 / torch.cosh(x.double()) ** 2
    rel = (slope.cpu().double() - exact_slope).abs() / exact_slope
    # Compiled, exp(-2|x|) takes its argument rounded to fp32 first: relative error |2x| u more
    # (3.4e-6 measured at |x| = 40 on an H100; the interpreter's numpy exp is exact there).
    allowed = 1e-6 + 2 * x.double().abs() * torch.finfo(torch.float32).eps
    assert (rel <= allowed).all(), (rel / allowed).max().item()
    # The naive slope from the rounded tanh, for contrast: wrong where |x| is large.
    naive = 1 - exact.float().double() ** 2
    assert ((naive - exact_slope).abs() / exact_slope).max().item() > 0.5
