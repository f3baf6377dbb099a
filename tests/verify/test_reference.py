"""The float64 reference R: on confident rows as precise as the implementations it judges; its
sums in one fixed order."""

from __future__ import annotations

import math

import pytest
import torch

from verify.numerics.reference import Upstream, ordered_sum, reference


def test_confident_row_keeps_relative_precision() -> None:
    # One token, V = 2, logits exactly [20, -20]: q = 1 - p_y = e^-40 / (1 + e^-40) ~ 4e-18 is
    # below float64's unit roundoff at 1. R used to form onehot - p and log(1 + q) as written:
    # 1 - p_y and log p_y came out 0, so its gradients were off by their whole size and it
    # failed implementations (lce) that keep 1 - p_y uncancelled. Closed forms for V = 2:
    # log p_y = -log1p(e), H = log1p(e) + 40 q; d_z = g_lp (onehot - p) - g_ent p (log p + H),
    # where log p_y + H = 40 q and log p_o + H = -40 p_y.
    hidden = torch.ones(1, 1, dtype=torch.float64)
    weight = torch.tensor([[20.0], [-20.0]], dtype=torch.float64)
    g_lp, g_ent = torch.tensor([0.3], dtype=torch.float64), torch.tensor([0.7], dtype=torch.float64)
    ref = reference(hidden, weight, torch.tensor([0]), upstream=Upstream(g_lp, g_ent))
    e = math.exp(-40.0)
    q, p_y = e / (1.0 + e), 1.0 / (1.0 + e)
    d_target = 0.3 * q - 0.7 * p_y * 40.0 * q
    d_other = -0.3 * q + 0.7 * q * 40.0 * p_y
    want = {
        "logprobs": [-math.log1p(e)],
        "entropy": [math.log1p(e) + 40.0 * q],
        "grad_hidden": [[20.0 * d_target - 20.0 * d_other]],
        "grad_weight": [[d_target], [d_other]],
    }
    for name, values in want.items():
        got, expected = getattr(ref, name), torch.tensor(values, dtype=torch.float64)
        # 1e-13 relative: a few float64 roundings of each closed form; the old R was off by ~100%.
        assert torch.allclose(got, expected, rtol=1e-13, atol=0.0), (name, got, expected)


def _padded_tree(x: torch.Tensor) -> torch.Tensor:
    """R's summation order as written down: the last dim padded with zeros to a power of two,
    then halves added until one is left."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    x = torch.nn.functional.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        x = x[..., : x.shape[-1] // 2] + x[..., x.shape[-1] // 2 :]
    return x[..., 0]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64, 65, 300, 4097])
def test_ordered_sum_adds_in_the_padded_tree_order_without_the_padding(n: int) -> None:
    """`ordered_sum` writes no padding (its first level adds the odd terms to +0.0) and sums along
    any dim in place: the same bits as the padded tree, negative zeros and infinities included
    (R's sha256 in every saved artifact rests on them)."""
    torch.manual_seed(n)
    x = torch.randn(3, n, 2, dtype=torch.float64) * torch.rand(3, n, 2, dtype=torch.float64) ** 8
    x.view(-1)[::5] = -0.0
    x.view(-1)[1] = math.inf
    got = ordered_sum(x, dim=1)
    want = _padded_tree(x.movedim(1, -1))
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
