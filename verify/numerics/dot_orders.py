"""fp32 dot products summed in the orders real kernels use, each addition rounded once.

Where every partial sum of a dot carries a large common offset, each addition rounds at ~|z| and
the order decides how many of them land there: two correct fp32 kernels may then be several u|z|
apart. `verify.properties.oracle.Oracle.dot_order_error` grants, per logit, the worst of these
orders: a GPU tile's K loop (`index_order_dots`) and a CPU BLAS
microkernel's vector accumulators (`lane_order_dots`, 2 to 32 lanes, folded in sequence or in
pairs). An fp32 product is exact in fp64, so ``(acc.double() + h * w).float()`` is one fused
multiply-add's rounding.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

# Vector accumulators of the lane orders: SSE (4), AVX2 (8), AVX-512 (16) fp32 lanes, a warp (32).
LANES = (2, 4, 8, 16, 32)


def index_order_dots(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``hidden @ weight.T`` summed k = 0..n-1, one rounding per step (a GPU tile's order):
    one lane of `lane_order_dots`."""
    return lane_order_dots(hidden, weight, 1)[0]


def lane_order_dots(
    hidden: torch.Tensor, weight: torch.Tensor, lanes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``hidden @ weight.T`` in ``lanes`` accumulators (lane l sums the products k = l mod
    ``lanes`` in index order, one rounding each), then the lanes folded in sequence and in pairs
    (``lanes`` a power of two, or 1): ``(sequential, pairwise)``."""
    pad = -hidden.shape[1] % lanes  # zero products: adding them rounds nothing
    steps = (hidden.shape[1] + pad) // lanes
    # fp32 operands in float64: each product exact, each sum rounded once to fp32 (one FMA)
    h = F.pad(hidden.float(), (0, pad)).double().reshape(hidden.shape[0], 1, steps, lanes)
    w = F.pad(weight.float(), (0, pad)).double().reshape(1, weight.shape[0], steps, lanes)
    acc = torch.zeros(hidden.shape[0], weight.shape[0], lanes, dtype=torch.float32)
    for step in range(steps):
        acc = (acc.double() + h[:, :, step] * w[:, :, step]).float()
    sequential = acc[..., 0]
    for lane in range(1, lanes):
        sequential = sequential + acc[..., lane]
    pairwise = acc
    while pairwise.shape[-1] > 1:
        pairwise = pairwise[..., 0::2] + pairwise[..., 1::2]
    return sequential, pairwise[..., 0]


def summation_orders(hidden: torch.Tensor, weight: torch.Tensor) -> Iterator[torch.Tensor]:
    """fp32 ``hidden @ weight.T`` in each order of this module (operands fp32). Once the lanes
    are as many as the products, each holds one (or none): a wider count folds the same values
    with zeros after them, the same sums, so none is summed again."""
    yield index_order_dots(hidden, weight)
    for lanes in LANES:
        yield from lane_order_dots(hidden, weight, lanes)
        if lanes >= hidden.shape[1]:
            break
