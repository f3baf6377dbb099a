"""The contract's edge clauses: ignored rows, bad input, layouts, autograd modes, invariances."""

from __future__ import annotations

import pytest
import torch

import lce
from tests.helpers.checks import (
    BACKENDS,
    assert_outputs_match,
    assert_within_tolerance,
    core_problem,
    reference_and_baseline,
    run_lce,
)
from verify.numerics.reference import IGNORE_INDEX, loss_upstream_grad
from verify.numerics.tolerances import load

T, H, V = 29, 24, 67


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_ignored_gives_zero_grads_and_nan_mean(backend):
    problem = core_problem(T, H, V, seed=3, ignore="all")
    hidden = problem.hidden.clone().requires_grad_()
    weight = problem.weight.clone().requires_grad_()
    loss = lce.linear_cross_entropy(hidden, weight, problem.targets, backend=backend)
    assert torch.isnan(loss), "mean over zero tokens follows PyTorch: NaN"
    loss.backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert torch.equal(weight.grad, torch.zeros_like(weight))
    total = lce.linear_cross_entropy(problem.hidden, weight, problem.targets, reduction="sum")
    assert total.item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_rows_are_exactly_zero_and_their_hidden_irrelevant(backend):
    problem = core_problem(T, H, V, seed=4)
    ignored = problem.targets == IGNORE_INDEX
    assert 0 < int(ignored.sum()) < T, "the case needs ignored and kept rows"
    hidden, weight, out = run_lce(problem, backend)
    upstream = [problem.grad_logprob, problem.grad_entropy]
    torch.autograd.backward([out.logprobs, out.entropy], upstream)
    assert torch.equal(out.logprobs[ignored], torch.zeros(int(ignored.sum())))
    assert torch.equal(out.entropy[ignored], torch.zeros(int(ignored.sum())))
    assert torch.equal(hidden.grad[ignored], torch.zeros_like(hidden.grad[ignored]))
    # Replace the ignored rows' hidden with huge values: nothing else may change, bit for bit.
    problem.hidden[ignored] = 1e4
    hidden2, weight2, out2 = run_lce(problem, backend)
    torch.autograd.backward([out2.logprobs, out2.entropy], upstream)
    assert torch.equal(out.logprobs, out2.logprobs)
    assert torch.equal(hidden.grad, hidden2.grad)
    assert torch.equal(weight.grad, weight2.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_targets_raise_naming_the_ids(backend):
    problem = core_problem(T, H, V, seed=5)
    targets = problem.targets.clone()
    targets[3], targets[7] = V, -5
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, V\): -5, 67"):
        lce.token_logprobs(problem.hidden, problem.weight, targets, backend=backend)
    # A custom ignore_index is ignored, not an error.
    targets[7] = IGNORE_INDEX
    targets[3] = -1
    out = lce.token_logprobs(
        problem.hidden, problem.weight, targets.where(targets != IGNORE_INDEX, -1), ignore_index=-1
    )
    assert out.logprobs[3] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(hidden=torch.zeros(4, 8), weight=torch.zeros(5, 9)), "hidden's last dim"),
        (dict(hidden=torch.zeros(4, 8), weight=torch.zeros(5, 8, 1)), "weight must be"),
        (dict(hidden=torch.zeros(8), weight=torch.zeros(5, 8)), "hidden must be"),
        (dict(targets=torch.zeros(3, dtype=torch.long)), "targets must have shape"),
        (dict(targets=torch.zeros(4)), "targets must be int64 or int32"),
        (dict(hidden=torch.zeros(4, 8, dtype=torch.int32)), "hidden must be a floating tensor"),
        (dict(temperature=0.0), "temperature must be"),
        (dict(reduction="avg"), "reduction must be one of"),
        (dict(backend="cuda"), "backend must be one of"),
        (dict(chunk_size=0), "chunk_size must be >= 1"),
        (
            dict(weight=torch.zeros(5, 8, dtype=torch.float64), backend="triton"),
            "use backend='torch' \\(or 'auto'\\) for float64",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, message):
    args = dict(
        hidden=torch.zeros(4, 8), weight=torch.zeros(5, 8), targets=torch.zeros(4, dtype=torch.long)
    )
    for name in ("hidden", "weight", "targets"):
        if name in kwargs:
            args[name] = kwargs.pop(name)
    with pytest.raises(ValueError, match=message):
        lce.linear_cross_entropy(args["hidden"], args["weight"], args["targets"], **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_3d_noncontiguous_inputs_and_strided_grads(backend):
    batch, seq = 3, 11
    problem = core_problem(batch * seq, H, V, seed=6)
    # hidden as a transposed [B, T, H] view; weight as a column slice of a wider tensor.
    hidden_3d = problem.hidden.view(seq, batch, H).transpose(0, 1).detach().requires_grad_()
    wide = torch.cat([problem.weight, torch.randn(V, 5)], dim=1)
    weight = wide[:, :H].detach().requires_grad_()
    targets = problem.targets.view(seq, batch).T
    assert not hidden_3d.is_contiguous() and not weight.is_contiguous()
    before = (hidden_3d.detach().clone(), weight.detach().clone(), targets.clone())
    out = lce.token_logprobs(hidden_3d, weight, targets, backend=backend, chunk_size=4)
    assert out.logprobs.shape == (batch, seq)
    grad_lp = problem.grad_logprob.view(seq, batch).T  # strided
    grad_ent = torch.tensor(0.3).expand(batch, seq)  # expanded, stride 0
    torch.autograd.backward([out.logprobs, out.entropy], [grad_lp, grad_ent])
    for original, now in zip(before, (hidden_3d, weight, targets), strict=True):
        assert torch.equal(original, now.detach()), "inputs must never be mutated"
    flat_hidden = hidden_3d.detach().reshape(-1, H)
    ref, base = reference_and_baseline(
        flat_hidden,
        weight.detach(),
        targets.reshape(-1),
        1.0,
        grad_lp.reshape(-1),
        grad_ent.reshape(-1),
    )
    kernel = {
        "logprobs": out.logprobs.reshape(-1),
        "entropy": out.entropy.reshape(-1),
        "grad_hidden": hidden_3d.grad.reshape(-1, H),
        "grad_weight": weight.grad,
    }
    assert_outputs_match(kernel, ref, base, torch.float32, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_tokens", [0, 1])
def test_zero_and_one_token(backend, num_tokens):
    problem = core_problem(num_tokens, H, V, seed=7, ignore="none")
    hidden, weight, out = run_lce(problem, backend)
    assert out.logprobs.shape == (num_tokens,)
    (out.logprobs * problem.grad_logprob).sum().backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
    if num_tokens == 0:
        assert torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("backend", BACKENDS)
def test_autograd_modes(backend):
    problem = core_problem(T, H, V, seed=8)
    frozen_weight = problem.weight.clone()
    hidden = problem.hidden.clone().requires_grad_()
    out = lce.token_logprobs(hidden, frozen_weight, problem.targets, backend=backend)
    (out.logprobs * problem.grad_logprob).sum().backward()
    assert hidden.grad is not None and frozen_weight.grad is None
    with torch.no_grad():
        out_ng = lce.token_logprobs(hidden, problem.weight, problem.targets, backend=backend)
    assert not out_ng.logprobs.requires_grad
    torch.testing.assert_close(out_ng.logprobs, out.logprobs, rtol=0, atol=0)
    # retain_graph: a second backward adds the same gradient again.
    _, weight2, out2 = run_lce(problem, backend)
    objective = (out2.logprobs * problem.grad_logprob + out2.entropy * problem.grad_entropy).sum()
    objective.backward(retain_graph=True)
    first = weight2.grad.clone()
    objective.backward()
    torch.testing.assert_close(weight2.grad, 2 * first, rtol=1e-6, atol=0)  # fp32 x2 is exact-ish


def test_chunk_size_invariance_is_exact_in_fp64():
    problem = core_problem(T, H, V, seed=9, dtypes=("fp64", "fp64"))
    runs = []
    for chunk_size in (1, 5, T):
        hidden, weight, out = run_lce(problem, "torch", temperature=0.9, chunk_size=chunk_size)
        torch.autograd.backward(
            [out.logprobs, out.entropy], [problem.grad_logprob, problem.grad_entropy]
        )
        outputs = (out.logprobs, out.entropy, hidden.grad.ravel(), weight.grad.ravel())
        runs.append(torch.cat(outputs))
    bound = load().exact["invariance_fp64"]
    for other in runs[1:]:
        assert (other - runs[0]).abs().max() <= bound * runs[0].abs().max()


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_fp64_scalar_loss_keeps_fp64_and_matches_the_reference(reduction):
    problem = core_problem(T, H, V, seed=10, dtypes=("fp64", "fp64"))
    hidden = problem.hidden.clone().requires_grad_()
    loss = lce.linear_cross_entropy(hidden, problem.weight, problem.targets, reduction=reduction)
    loss.backward(torch.tensor(0.4, dtype=torch.float64))
    valid = problem.targets != IGNORE_INDEX
    upstream = loss_upstream_grad(valid, reduction, torch.tensor(0.4, dtype=torch.float64))
    ref, base = reference_and_baseline(
        problem.hidden, problem.weight, problem.targets, 1.0, None, None, upstream
    )
    assert hidden.grad.dtype == torch.float64
    triples = {
        "loss": (loss, ref.loss(reduction), base.loss(reduction)),
        "grad_hidden": (hidden.grad, ref.grad_hidden, base.grad_hidden),
    }
    assert_within_tolerance(triples, torch.float64, torch.float64)
