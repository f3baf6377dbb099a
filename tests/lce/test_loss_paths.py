"""The scalar loss's three paths on both backends: default (4 GEMMs), ``fast`` (3 GEMMs, an fp32
buffer of lce's own) and ``grad_weight_into`` (3 GEMMs into a caller's buffer, Megatron's
main_grad conventions), each against the float64 reference under tolerances.yaml."""

from __future__ import annotations

import pytest
import torch

import lce
from lce.backends.triton import TritonStages
from lce.validation import HOST_CHECKS_ENV
from tests.helpers.checks import (
    BACKENDS,
    DTYPES,
    assert_within_tolerance,
    confident_problem,
    core_problem,
    reference_and_baseline,
)
from verify.numerics.reference import Upstream, loss_upstream_grad, reference

T, H, V = 37, 40, 97
# Not 1 and negative, so the buffer path's forward assumption (an upstream of 1) fails on every
# row and backward settles the difference; 1.0 is where the assumption holds.
GRAD_LOSSES = (1.0, -0.37)
# float32 cases on Triton run under the interpreter; bf16's interpreted tl.dot is not trusted.
PATH_DTYPES = {k: DTYPES[k] for k in ("fp32", "fp16", "fp32_bf16")}
# On a GPU machine the same tests run the compiled kernels (the comparisons stay on the CPU).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _host_checks(monkeypatch):
    """`GRAD_LOSSES` holds an upstream the buffer path does not assume: on CUDA lce's default
    there is a device-side assert, which would end the test worker's CUDA context (and every
    later test in it); the host check recomputes the rows exactly, as on the CPU."""
    monkeypatch.setenv(HOST_CHECKS_ENV, "1")


def _leaves(problem, device=DEVICE):
    hidden, weight = (t.to(device).requires_grad_() for t in (problem.hidden, problem.weight))
    return hidden, weight, problem.targets.to(device)


def _expected(problem, reduction, grad_loss):
    valid = problem.valid
    upstream = loss_upstream_grad(valid, reduction, grad_loss.double())
    return reference_and_baseline(
        problem.hidden, problem.weight, problem.targets, 1.3, None, None, upstream
    )


def _upstream(problem, reduction, grad_loss):
    return problem.grad_logprob if reduction == "none" else torch.tensor(grad_loss)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtypes", PATH_DTYPES.values(), ids=PATH_DTYPES.keys())
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("grad_loss", GRAD_LOSSES)
def test_buffer_receives_its_old_content_plus_the_gradient(backend, dtypes, reduction, grad_loss):
    problem = core_problem(T, H, V, seed=4, dtypes=dtypes)
    hidden, weight, targets = _leaves(problem)
    upstream = _upstream(problem, reduction, grad_loss)
    ref, base = _expected(problem, reduction, upstream)
    # Old content as large as the gradient, as after other micro-batches: every fp32 addition
    # into the buffer then rounds at the gradient's scale (the fp32 tolerance's floor).
    old = torch.randn(V, H, generator=torch.Generator().manual_seed(5))
    old = (old * ref.grad_weight.abs().max()).float()
    buffer = old.to(DEVICE, copy=True)
    loss = lce.linear_cross_entropy(
        hidden, weight, targets, reduction=reduction, temperature=1.3, backend=backend,
        chunk_size=16, grad_weight_into=buffer,
    )  # fmt: skip
    loss.backward(upstream.to(DEVICE))
    assert weight.grad is None  # as megatron-core's layers leave it without its DDP
    triples = {
        "loss": (loss.detach().cpu(), ref.loss(reduction), base.loss(reduction)),
        "grad_hidden": (hidden.grad.cpu(), ref.grad_hidden, base.grad_hidden),
        "grad_weight": (buffer.cpu() - old, ref.grad_weight, base.grad_weight),
    }
    assert_within_tolerance(triples, *dtypes)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtypes", PATH_DTYPES.values(), ids=PATH_DTYPES.keys())
@pytest.mark.parametrize("fast", [False, True])
def test_default_and_fast_paths_match_the_reference(backend, dtypes, fast):
    problem = core_problem(T, H, V, seed=6, dtypes=dtypes)
    hidden, weight, targets = _leaves(problem)
    loss = lce.linear_cross_entropy(
        hidden, weight, targets, temperature=1.3, backend=backend, chunk_size=16, fast=fast
    )
    loss.backward(torch.tensor(-0.37, device=DEVICE))
    ref, base = _expected(problem, "mean", torch.tensor(-0.37))
    assert weight.grad.dtype == problem.weight.dtype
    triples = {
        "loss": (loss.detach().cpu(), ref.loss("mean"), base.loss("mean")),
        "grad_hidden": (hidden.grad.cpu(), ref.grad_hidden, base.grad_hidden),
        "grad_weight": (weight.grad.cpu(), ref.grad_weight, base.grad_weight),
    }
    assert_within_tolerance(triples, *dtypes)


def test_the_default_scalar_loss_recomputes_and_fast_does_not(monkeypatch):
    """Default: logits twice (forward stats, backward); fast and the buffer path: once."""
    problem = core_problem(T, H, V, seed=7)
    calls = []
    stages = lce.backends.torch_chunked.TorchChunkedStages
    for name in ("forward_stats", "backward_grads", "loss_grads_in_forward"):
        original = getattr(stages, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(stages, name, spy)
    for kwargs in ({}, {"fast": True}, {"grad_weight_into": torch.zeros(V, H)}):
        calls.clear()
        hidden, weight, targets = _leaves(problem, "cpu")
        lce.linear_cross_entropy(hidden, weight, targets, backend="torch", **kwargs).backward()
        expected = ["loss_grads_in_forward"] if kwargs else ["forward_stats", "backward_grads"]
        assert calls == expected, kwargs


class MegatronParam:
    """The two attributes megatron-core's DDP and tied embeddings put on a parameter."""

    def __init__(self, zero_out_wgrad: bool) -> None:
        self.zero_out_wgrad = zero_out_wgrad


@pytest.mark.parametrize("zero_out_wgrad", [False, True])
def test_megatron_ddp_flags(zero_out_wgrad):
    """With ``grad_added_to_main_grad`` (Megatron's DDP): a dummy gradient and the flag set, zeros
    for ``zero_out_wgrad`` (tied embeddings: the hook then adds .grad, so it must be 0 here)."""
    problem = core_problem(T, H, V, seed=8)
    hidden, weight, targets = _leaves(problem, "cpu")
    weight.grad_added_to_main_grad = False
    weight.zero_out_wgrad = zero_out_wgrad
    buffer = torch.zeros(V, H)
    lce.linear_cross_entropy(
        hidden, weight, targets, backend="torch", grad_weight_into=buffer
    ).backward()
    assert weight.grad_added_to_main_grad is True
    assert weight.grad.shape == weight.shape and weight.grad.dtype == weight.dtype
    if zero_out_wgrad:
        assert torch.equal(weight.grad, torch.zeros_like(weight))
    assert buffer.abs().sum() > 0


def test_buffer_is_untouched_without_weight_grads_and_on_bad_targets():
    problem = core_problem(T, H, V, seed=9)
    hidden = problem.hidden.clone().requires_grad_()
    buffer = torch.ones(V, H)
    loss = lce.linear_cross_entropy(
        hidden, problem.weight, problem.targets, backend="torch", grad_weight_into=buffer
    )
    loss.backward()
    assert hidden.grad is not None and torch.equal(buffer, torch.ones(V, H))
    hidden, weight, _ = _leaves(problem, "cpu")
    bad = problem.targets.clone()
    bad[0] = V
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lce.linear_cross_entropy(hidden, weight, bad, backend="torch", grad_weight_into=buffer)
    assert torch.equal(buffer, torch.ones(V, H))


@pytest.mark.parametrize(
    ("buffer", "message"),
    [
        (torch.zeros(V, H, dtype=torch.bfloat16), "must be a torch.float32 tensor"),
        (torch.zeros(V + 1, H), "must have weight's shape"),
        ([0.0], "must be a torch.float32 tensor"),
    ],
)
def test_bad_buffers_are_refused(buffer, message):
    problem = core_problem(T, H, V, seed=10)
    hidden, weight, targets = _leaves(problem, "cpu")
    with pytest.raises(ValueError, match=f"grad_weight_into {message}"):
        lce.linear_cross_entropy(hidden, weight, targets, grad_weight_into=buffer)


def test_triton_logits_chunks_split_the_tokens(monkeypatch):
    """The Triton 3-GEMM path's token chunking: 1 row per chunk gives the one-chunk result."""
    problem = core_problem(T, H, V, seed=11)
    results = []
    for rows in (1, T):
        monkeypatch.setattr(TritonStages, "loss_chunk_rows", lambda *_, r=rows: r)
        hidden, weight, targets = _leaves(problem)
        lce.linear_cross_entropy(hidden, weight, targets, backend="triton", fast=True).backward()
        results.append((hidden.grad, weight.grad))
    # fp32 sums in another order: a few ulps of the largest gradient entries.
    for one_row, whole in zip(*results, strict=True):
        torch.testing.assert_close(one_row, whole, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["fast", "main_grad"])
def test_confident_rows_keep_relative_precision(backend, path):
    """The 3-GEMM paths' log-probs and gradients of confident fp32 rows (target 12 to 22 above
    every other logit) keep fp32's relative precision, as the 4-GEMM path does (test_core)."""
    hidden, weight, targets, _, _ = confident_problem([12.0, 14.0, 16.0, 18.0, 20.0, 22.0])
    h, w = hidden.to(DEVICE).requires_grad_(), weight.to(DEVICE).requires_grad_()
    buffer = torch.zeros(weight.shape, device=DEVICE)
    kwargs = {"fast": True} if path == "fast" else {"grad_weight_into": buffer}
    loss = lce.linear_cross_entropy(h, w, targets.to(DEVICE), reduction="sum", backend=backend,
                                    **kwargs)  # fmt: skip
    loss.backward()
    ref = reference(hidden, weight, targets, upstream=Upstream(loss=torch.ones(len(targets))))
    grad_weight = w.grad if path == "fast" else buffer
    # The bound of test_core's confident-row test: one logit's worst fp32 error, relative per row.
    delta = hidden.shape[1] * 2.0**-24 * (hidden.abs() @ weight.abs().T).max().item()
    for name, got, want in [
        ("loss", loss.detach().reshape(1), -ref.logprobs.sum().reshape(1)),
        ("grad_hidden", h.grad, ref.grad_hidden),
        ("grad_weight", grad_weight, ref.grad_weight),
    ]:
        err = (got.cpu().double() - want).abs().reshape(want.shape[0], -1).amax(dim=1)
        scale = want.abs().reshape(want.shape[0], -1).amax(dim=1)
        worst = (err / scale).max().item()
        assert worst <= delta, f"{name}: row relative error {worst:.3g} > {delta:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["fast", "main_grad"])
def test_no_tokens(backend, path):
    """T = 0 (found by the engine at TP=2: the fast path's blockwise cast indexed row 0)."""
    hidden = torch.zeros(0, H, device=DEVICE, requires_grad=True)
    weight = torch.randn(V, H, device=DEVICE, requires_grad=True)
    buffer = torch.ones(V, H, device=DEVICE)
    kwargs = {"fast": True} if path == "fast" else {"grad_weight_into": buffer}
    targets = torch.zeros(0, dtype=torch.long, device=DEVICE)
    lce.linear_cross_entropy(hidden, weight, targets, reduction="sum", backend=backend,
                             **kwargs).backward()  # fmt: skip
    assert hidden.grad.shape == (0, H)
    assert torch.equal(buffer, torch.ones_like(buffer))
    assert path == "main_grad" or torch.equal(weight.grad, torch.zeros_like(weight))
