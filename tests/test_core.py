"""lce forward and backward vs the float64 reference, on every backend, dtype and option."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import lce
from tests.checks import assert_outputs_match, assert_within_tolerance, reference_and_baseline
from tests.problems import IGNORE, make_problem
from verify.reference import loss_upstream_grad

BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("triton") is None, reason="triton is not installed"
        ),
    ),
]
DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16),
    "fp32_bf16": (torch.float32, torch.bfloat16),
}
# Small shapes: V=97 is prime (never a multiple of a tile), H=40 is not a multiple of 16.
T, H, V = 37, 40, 97


def run_lce(problem, backend, temperature=1.0, chunk_size=8, **kwargs):
    hidden = problem.hidden.clone().requires_grad_()
    weight = problem.weight.clone().requires_grad_()
    out = lce.token_logprobs(
        hidden,
        weight,
        problem.targets,
        temperature=temperature,
        backend=backend,
        chunk_size=chunk_size,
        **kwargs,
    )
    return hidden, weight, out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtypes", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_outputs_and_grads_match_reference(backend, dtypes, temperature):
    problem = make_problem(T, H, V, *dtypes, seed=1)
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
    problem = make_problem(T, H, V, *dtypes, seed=2)
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
    valid = problem.targets != IGNORE
    upstream = loss_upstream_grad(valid, reduction, grad_loss.double())
    ref, base = reference_and_baseline(
        problem.hidden, problem.weight, problem.targets, 1.3, upstream, None
    )
    kernel = {"grad_hidden": hidden.grad, "grad_weight": weight.grad}
    assert_outputs_match(kernel, ref, base, *dtypes)
    triples = {"loss": (loss, ref.loss(reduction), base.loss(reduction))}
    assert_within_tolerance(triples, *dtypes)
