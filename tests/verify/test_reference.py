"""The float64 reference R on confident rows: as precise as the implementations it judges."""

from __future__ import annotations

import math

import torch

from verify.numerics.reference import Upstream, reference


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
