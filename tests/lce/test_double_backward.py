"""Double backward (``create_graph=True``): right on the torch backend's default path (per-token
outputs and the scalar loss), a clear error everywhere else, never silent zeros."""

from __future__ import annotations

import pytest
import torch

import lce
from tests.helpers.checks import BACKENDS

T, H, V = 6, 5, 7
TEMPERATURE = 0.7


def _problem(dtype=torch.float64):
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(T, H, generator=gen, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen, dtype=dtype) * 2).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=gen)
    targets[2] = -100
    return hidden, weight, targets


def test_gradgradcheck_in_fp64_on_the_torch_backend():
    hidden, weight, targets = _problem()

    def outputs(hidden, weight):
        out = lce.token_logprobs(hidden, weight, targets, backend="torch", temperature=TEMPERATURE)
        return out.logprobs, out.entropy

    # Random upstream and second-order upstream gradients, checked against finite differences.
    assert torch.autograd.gradgradcheck(outputs, (hidden, weight))


def _penalty(loss_fn, hidden, weight):
    (grad_weight,) = torch.autograd.grad(loss_fn(hidden, weight), weight, create_graph=True)
    penalty = (grad_weight**2).sum()
    return penalty, torch.autograd.grad(penalty, (hidden, weight))


def test_gradient_penalty_equals_the_stock_path():
    """The issue's case: per-token torch gave second-order terms of 0.0 (stock: nonzero)."""
    hidden, weight, targets = _problem(torch.float32)
    valid = targets != -100

    def stock(hidden, weight):
        logp = torch.log_softmax(hidden @ weight.T / TEMPERATURE, dim=-1)
        return -torch.where(
            valid, logp.gather(1, targets.clamp_min(0)[:, None]).squeeze(1), 0
        ).sum()

    def fused(hidden, weight):
        return lce.linear_cross_entropy(
            hidden, weight, targets, reduction="none", backend="torch", temperature=TEMPERATURE
        ).sum()

    expected, expected_grads = _penalty(stock, hidden, weight)
    penalty, grads = _penalty(fused, hidden, weight)
    # fp32 through differently ordered sums: a few eps of the values' scale (~1e2 here).
    torch.testing.assert_close(penalty, expected, rtol=1e-5, atol=0)
    for got, want in zip(grads, expected_grads, strict=True):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_unsupported_double_backward_raises_naming_it(backend, reduction):
    """The torch backend's default path is differentiable twice for every reduction (the scalar
    loss is a reduction of the per-token path); Triton refuses, never returning silent zeros."""
    hidden, weight, targets = _problem(torch.float32)
    loss = lce.linear_cross_entropy(hidden, weight, targets, reduction=reduction, backend=backend)
    if backend == "torch":
        (grad,) = torch.autograd.grad(loss.sum(), weight, create_graph=True)
        assert grad.requires_grad
        return
    with pytest.raises(RuntimeError, match=r"double backward .*create_graph=True"):
        torch.autograd.grad(loss.sum(), weight, create_graph=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_the_3_gemm_loss_refuses_double_backward(backend, reduction):
    """fast=True computes the gradients in the forward: nothing is left to differentiate."""
    hidden, weight, targets = _problem(torch.float32)
    loss = lce.linear_cross_entropy(
        hidden, weight, targets, reduction=reduction, backend=backend, fast=True
    )
    with pytest.raises(RuntimeError, match=r"double backward .*create_graph=True"):
        torch.autograd.grad(loss, weight, create_graph=True)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_scalar_loss_gradient_penalty_passes_gradgradcheck(reduction):
    hidden, weight, targets = _problem()

    def loss(hidden, weight):
        return lce.linear_cross_entropy(
            hidden, weight, targets, reduction=reduction, backend="torch", temperature=TEMPERATURE
        )

    assert torch.autograd.gradgradcheck(loss, (hidden, weight))


def test_the_property_engine_checks_double_backward(monkeypatch):
    """verify's double_backward property passes lce and fails a silent-zero second order."""
    import lce.ops
    from lce.backends.base import Grads
    from verify.cases.spec import CaseSpec
    from verify.running.engine import check_case

    spec = CaseSpec(tokens=5, vocab=17, seed=3, ignore="random", reduction="none")
    assert all(v.passed for v in check_case(spec, properties=["double_backward"]))
    original = lce.ops.grads_with_graph

    def detached(*args):  # the old behaviour: right first order, no graph behind it
        return Grads(*(None if g is None else g.detach() for g in original(*args)))

    monkeypatch.setattr(lce.ops, "grads_with_graph", detached)
    verdicts = check_case(spec, properties=["double_backward"])
    assert [v.passed for v in verdicts] == [False, False], [v.line() for v in verdicts]


@pytest.mark.parametrize("ignore_index", [-1, 0])
def test_the_property_uses_the_specs_ignore_index(ignore_index):
    """The GPU nightly's campaign drew ignore_index=-1: the property passed lce -100 and lce
    rightly refused the target -1, a harness error in the report."""
    from verify.cases.spec import CaseSpec
    from verify.running.engine import check_case

    spec = CaseSpec(tokens=7, vocab=11, seed=5, ignore="first", ignore_index=ignore_index)
    for reduction in ("none", "sum"):
        verdicts = check_case(spec.with_(reduction=reduction), properties=["double_backward"])
        assert len(verdicts) == 2 and all(v.passed for v in verdicts), [v.line() for v in verdicts]
        assert all(v.tier != "harness" for v in verdicts)
