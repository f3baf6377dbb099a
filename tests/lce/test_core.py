"""lce forward and backward vs the float64 reference, on every backend, dtype and option."""

from __future__ import annotations

import pytest
import torch

import lce
from tests.helpers.checks import (
    BACKENDS,
    DTYPES,
    assert_outputs_match,
    assert_within_tolerance,
    confident_problem,
    core_problem,
    reference_and_baseline,
    run_lce,
)
from verify.numerics.reference import IGNORE_INDEX, Upstream, loss_upstream_grad, reference

# Small shapes: V=97 is prime (never a multiple of a tile), H=40 is not a multiple of 16.
T, H, V = 37, 40, 97


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtypes", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_outputs_and_grads_match_reference(backend, dtypes, temperature):
    problem = core_problem(T, H, V, seed=1, dtypes=dtypes)
    hidden, weight, out = run_lce(problem, backend, temperature)
    # Random upstream gradients on both outputs at once.
    torch.autograd.backward(
        [out.logprobs, out.entropy], [problem.grad_logprob, problem.grad_entropy]
    )
    ref, base = reference_and_baseline(
        problem.hidden,
        problem.weight,
        problem.targets,
        temperature,
        problem.grad_logprob,
        problem.grad_entropy,
    )
    assert hidden.grad.dtype == problem.hidden.dtype
    assert weight.grad.dtype == problem.weight.dtype
    kernel = {
        "logprobs": out.logprobs,
        "entropy": out.entropy,
        "grad_hidden": hidden.grad,
        "grad_weight": weight.grad,
    }
    assert_outputs_match(kernel, ref, base, *dtypes)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtypes", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_loss_reductions_match_reference(backend, dtypes, reduction):
    problem = core_problem(T, H, V, seed=2, dtypes=dtypes)
    hidden = problem.hidden.clone().requires_grad_()
    weight = problem.weight.clone().requires_grad_()
    loss = lce.linear_cross_entropy(
        hidden,
        weight,
        problem.targets,
        reduction=reduction,
        temperature=1.3,
        backend=backend,
        chunk_size=16,
    )
    # A scalar upstream gradient != 1, or a random per-token one for reduction="none".
    grad_loss = problem.grad_logprob if reduction == "none" else torch.tensor(-0.37)
    loss.backward(grad_loss)
    valid = problem.targets != IGNORE_INDEX
    upstream = loss_upstream_grad(valid, reduction, grad_loss.double())
    ref, base = reference_and_baseline(
        problem.hidden, problem.weight, problem.targets, 1.3, None, None, upstream
    )
    kernel = {"grad_hidden": hidden.grad, "grad_weight": weight.grad}
    assert_outputs_match(kernel, ref, base, *dtypes)
    triples = {"loss": (loss, ref.loss(reduction), base.loss(reduction))}
    assert_within_tolerance(triples, *dtypes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_confident_rows_keep_relative_precision(backend):
    """1 - p_y is a ratio of sums, never 1 - p_y rounded: a confident row's log-prob and gradients
    keep fp32's relative precision (found by the campaign: scale 10, temperature 0.25 rows had
    grad_weight ~1e-3 off, the torch backend worse)."""
    hidden, weight, targets, g_lp, g_ent = confident_problem([12.0, 14.0, 16.0, 18.0, 20.0, 22.0])
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = lce.token_logprobs(h, w, targets, backend=backend)
    torch.autograd.backward([out.logprobs, out.entropy], [g_lp, g_ent])
    ref = reference(hidden, weight, targets, upstream=Upstream(g_lp, g_ent))
    # delta: the worst-case fp32 error of one logit (H rounded products). Every output checked is
    # a smooth function of logit differences, so fp32 math can be held to delta relative per row:
    # measured <= 0.14 delta on both backends; the old 1 - p_y was off by 26 to 260000 delta.
    delta = hidden.shape[1] * 2.0**-24 * (hidden.abs() @ weight.abs().T).max().item()
    for name, got, want in [
        ("logprobs", out.logprobs, ref.logprobs),
        ("grad_hidden", h.grad, ref.grad_hidden),
        ("grad_weight", w.grad, ref.grad_weight),
    ]:
        err = (got.double() - want).abs().reshape(want.shape[0], -1).amax(dim=1)
        scale = want.abs().reshape(want.shape[0], -1).amax(dim=1)
        worst = (err / scale).max().item()
        assert worst <= delta, f"{name}: row relative error {worst:.3g} > {delta:.3g}"
