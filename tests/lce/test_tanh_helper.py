"""The Triton kernels' softcap map (`lce.backends.triton.tiles.logit_map`): the interpreter has no
libdevice, so one tanh formula serves both modes, and it must be as good as a library tanh."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402 (after the skip)

from lce.backends.triton.tiles import logit_map  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _kernel(x_ptr, t_ptr, slope_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    t, slope = logit_map(tl.load(x_ptr + offs), None, 1.0, False, True)
    tl.store(t_ptr + offs, t)
    tl.store(slope_ptr + offs, slope)


def test_tanh_is_accurate_on_every_range_and_its_slope_is_the_torch_backends():
    """Against float64: tanh within 4 ulps relative on every range (tiny, around the branch at
    0.625, saturated); its slope is ``(1 - t)(1 + t)`` of the rounded t bit for bit, as the torch
    backend's `cap_slope` forms it, within the tolerance model's 4 ulps of 1 absolutely."""
    ranges = [(1e-30, 1e-6), (1e-6, 0.6), (0.6, 0.65), (0.65, 40.0)]  # 2 x 4 x 256: a power of 2
    x = torch.cat([torch.linspace(lo, hi, 256, dtype=torch.float64) for lo, hi in ranges])
    x = torch.cat([x, -x]).float()
    t, slope = torch.empty_like(x, device=DEVICE), torch.empty_like(x, device=DEVICE)
    _kernel[(1,)](x.to(DEVICE), t, slope, N=x.numel())
    t, slope = t.cpu(), slope.cpu()
    exact = torch.tanh(x.double())
    eps = torch.finfo(torch.float32).eps
    err_ulps = (t.double() - exact).abs() / (eps * exact.abs())
    assert err_ulps.max().item() <= 4, err_ulps.max().item()
    assert torch.equal(slope, (1 - t) * (1 + t))
    exact_slope = 1 / torch.cosh(x.double()) ** 2
    assert (slope.double() - exact_slope).abs().max().item() <= 4 * eps
