"""The opt-in per-token path that keeps its logits from forward to backward
(`TritonConfig.keep_logits_bytes`): outputs and gradients against the float64 reference under
tolerances.yaml, the budget that decides it, and a second backward (the logits are spent)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import lce
from lce.backends.triton import config as triton_config
from lce.backends.triton import kept_logits, stages
from tests.helpers.checks import assert_outputs_match, core_problem, reference_and_baseline

T, H, V = 37, 40, 97
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp16 and fp32 operands: bf16's interpreted tl.dot is not trusted; fp32_bf16 rounds its logits
# to bf16, the case where keeping them differs most from the fused kernels' fp32 dots.
KEPT_DTYPES = {"fp32": ("fp32", "fp32"), "fp16": ("fp16", "fp16"), "fp32_bf16": ("fp32", "bf16")}


@pytest.fixture
def keep_budget(monkeypatch):
    """Set the budget of the config the stages read (interpreter's or GPU's)."""

    def set_budget(budget: int) -> None:
        name = "INTERPRETER_CONFIG" if triton_config.interpreting() else "GPU_CONFIG"
        config = dataclasses.replace(getattr(triton_config, name), keep_logits_bytes=budget)
        monkeypatch.setattr(triton_config, name, config)

    return set_budget


def _run(problem, temperature, chunk_size=None):
    hidden, weight = (t.to(DEVICE).requires_grad_() for t in (problem.hidden, problem.weight))
    out = lce.token_logprobs(
        hidden, weight, problem.targets.to(DEVICE), temperature=temperature, backend="triton",
        chunk_size=chunk_size,
    )  # fmt: skip
    return hidden, weight, out


def _spy_kept(monkeypatch) -> list[str]:
    """Record which forward and backward the stages take."""
    calls = []
    forward, backward = kept_logits.forward_with_kept_logits, kept_logits.backward_from_kept_logits

    def spy_forward(*args, **kwargs):
        calls.append("kept forward")
        return forward(*args, **kwargs)

    def spy_backward(*args, **kwargs):
        calls.append("kept backward")
        return backward(*args, **kwargs)

    monkeypatch.setattr(stages, "forward_with_kept_logits", spy_forward)
    monkeypatch.setattr(stages, "backward_from_kept_logits", spy_backward)
    return calls


@pytest.mark.parametrize("dtypes", KEPT_DTYPES.values(), ids=KEPT_DTYPES.keys())
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_logits_match_the_reference(keep_budget, monkeypatch, dtypes, temperature):
    """Random upstream gradients on log-probs and entropy: every output within its tolerance."""
    keep_budget(1 << 30)
    calls = _spy_kept(monkeypatch)
    problem = core_problem(T, H, V, seed=21, dtypes=dtypes)
    hidden, weight, out = _run(problem, temperature)
    torch.autograd.backward(
        [out.logprobs, out.entropy],
        [problem.grad_logprob.to(DEVICE), problem.grad_entropy.to(DEVICE)],
    )
    assert calls == ["kept forward", "kept backward"]
    ref, base = reference_and_baseline(
        problem.hidden, problem.weight, problem.targets, temperature, problem.grad_logprob,
        problem.grad_entropy,
    )  # fmt: skip
    assert hidden.grad.dtype == problem.hidden.dtype
    assert weight.grad.dtype == problem.weight.dtype
    kernel = {
        "logprobs": out.logprobs.cpu(),
        "entropy": out.entropy.cpu(),
        "grad_hidden": hidden.grad.cpu(),
        "grad_weight": weight.grad.cpu(),
    }
    assert_outputs_match(kernel, ref, base, *dtypes)


def test_the_budget_and_chunk_size_decide(keep_budget, monkeypatch):
    """Logits over the budget, or token chunks asked for: the fused 4-GEMM kernels run."""
    calls = _spy_kept(monkeypatch)
    problem = core_problem(T, H, V, seed=22)
    logits_bytes = T * V * 4
    for budget, chunk_size, kept in [
        (logits_bytes, None, True),
        (logits_bytes - 1, None, False),
        (1 << 30, 16, False),
        (0, None, False),
    ]:
        keep_budget(budget)
        calls.clear()
        _, _, out = _run(problem, 1.0, chunk_size)
        out.logprobs.sum().backward()
        assert calls == (["kept forward", "kept backward"] if kept else []), (budget, chunk_size)


def test_a_second_backward_recomputes(keep_budget, monkeypatch):
    """The first backward overwrites the kept logits with d_logits; a second one (retain_graph)
    recomputes them with the fused kernels and gives the same gradients."""
    keep_budget(1 << 30)
    calls = _spy_kept(monkeypatch)
    problem = core_problem(T, H, V, seed=23)
    hidden, weight, out = _run(problem, 1.0)
    loss = (out.logprobs * problem.grad_logprob.to(DEVICE)).sum()
    first = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight))
    assert calls == ["kept forward", "kept backward"]
    # fp32 dots summed in another order (cuBLAS or torch against tl.dot): a few ulps of each
    # gradient's norm (one element of a compiled run differed by 2.6e-4 of itself, a sum that
    # cancels).
    for got, want in zip(second, first, strict=True):
        assert ((got - want).norm() / want.norm()).item() <= 1e-5
