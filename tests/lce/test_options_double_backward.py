"""Double backward (``create_graph=True``) with the logit options: right on the torch backend's
default path (the materialized second-order graph applies the same map and loss terms), checked
by gradgradcheck in float64 against finite differences; refused with the clear error on Triton."""

from __future__ import annotations

import pytest
import torch

import lce
from tests.helpers.option_reference import ALL_OPTIONS, MAP_FIELDS, leaf, make_problem

PROBLEM = make_problem(seed=5, tokens=4, hidden_size=3, vocab=5)
MAP = {name: ALL_OPTIONS[name] for name in MAP_FIELDS}
# A cap the logits (|a| ~ 5) bend under, so the second derivative of tanh matters.
OPTIONS = {**ALL_OPTIONS, "softcap": 2.0}


def _leaves():
    return tuple(leaf(t, torch.float64) for t in (PROBLEM.hidden, PROBLEM.weight, PROBLEM.bias))


def test_token_outputs_pass_gradgradcheck_with_the_map():
    def outputs(hidden, weight, bias):
        out = lce.token_logprobs(
            hidden, weight, PROBLEM.targets, bias=bias, backend="torch",
            **{**MAP, "softcap": 2.0},
        )  # fmt: skip
        return out.logprobs, out.entropy

    assert torch.autograd.gradgradcheck(outputs, _leaves())


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_the_loss_with_every_term_passes_gradgradcheck(reduction):
    def loss(hidden, weight, bias):
        return lce.linear_cross_entropy(
            hidden, weight, PROBLEM.targets, bias=bias, backend="torch", reduction=reduction,
            **OPTIONS,
        )  # fmt: skip

    assert torch.autograd.gradgradcheck(loss, _leaves())


def test_triton_refuses_with_the_options_too():
    pytest.importorskip("triton")
    hidden, weight, bias = (t.float().detach().requires_grad_() for t in _leaves())
    loss = lce.linear_cross_entropy(
        hidden, weight, PROBLEM.targets, bias=bias, backend="triton", **OPTIONS
    )
    with pytest.raises(RuntimeError, match=r"double backward .*create_graph=True"):
        torch.autograd.grad(loss, bias, create_graph=True)


def test_the_differentiable_gradients_equal_the_first_order_ones():
    """gradgradcheck checks the second-order graph against finite differences of the first-order
    gradients it differentiates: that graph must also give the right first order (a map or loss
    term left out of it would be consistent with itself). fp64: only summation order differs."""
    upstream = torch.linspace(-1.0, 2.0, PROBLEM.targets.numel(), dtype=torch.float64)
    grads = []
    for create_graph in (False, True):
        leaves = _leaves()
        loss = lce.linear_cross_entropy(
            *leaves[:2], PROBLEM.targets, bias=leaves[2], backend="torch", reduction="none",
            **OPTIONS,
        )  # fmt: skip
        grads.append(torch.autograd.grad(loss, leaves, upstream, create_graph=create_graph))
    for plain, with_graph in zip(*grads, strict=True):
        assert with_graph.requires_grad
        torch.testing.assert_close(with_graph, plain, rtol=1e-12, atol=1e-14)
