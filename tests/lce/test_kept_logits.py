"""Kept logits (``keep_logits_bytes``): where this rank's ``[T, V_local]`` logits fit the caller's
budget, the forward keeps them and the backward reads them instead of recomputing (3 GEMMs).

What can go wrong, each asserted here: the budget's boundary (``T * V_local * itemsize``, this
rank's rows), the backward still recomputing (a silently skipped option), a second backward
reading logits the first consumed, the numbers (torch: bit for bit the recomputing path, whose
logits are rounded to weight's dtype alike; Triton: against the reference under tolerances.yaml).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import lce
from lce.backends.base import Wanted
from lce.backends.torch_chunked import TorchChunkedStages
from lce.call import Call, encode_call, keeps_logits
from lce.options import LCEOptions
from tests.helpers.checks import BACKENDS, DTYPES, assert_within_tolerance, core_problem
from tests.helpers.logit_rows import logit_rows_computed
from verify.numerics.reference import Upstream, baseline, reference

T, H, V = 37, 40, 97
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPTIONS = dict(temperature=0.7, logit_scale=1.3, softcap=5.0)
# Interpreted Triton: bf16's interpreted tl.dot is not trusted, but the kept route's dots are
# cuBLAS's (torch's off CUDA), so bf16 runs here too.
KEPT_DTYPES = {k: DTYPES[k] for k in ("fp32", "bf16", "fp32_bf16")}


def _leaves(problem, device=DEVICE):
    hidden, weight = (t.to(device).requires_grad_() for t in (problem.hidden, problem.weight))
    bias = torch.linspace(-1.0, 1.0, V, dtype=problem.weight.dtype, device=device)
    return hidden, weight, bias.requires_grad_(), problem.targets.to(device)


def _budget(hidden: torch.Tensor, weight: torch.Tensor) -> int:
    return hidden.shape[0] * weight.shape[0] * weight.element_size()


def _token_run(problem, backend, keep, **kwargs):
    """Outputs and gradients (hidden, weight, bias) under the problem's random upstreams."""
    hidden, weight, bias, targets = _leaves(problem)
    out = lce.token_logprobs(
        hidden, weight, targets, bias=bias, backend=backend, keep_logits_bytes=keep, **OPTIONS,
        **kwargs,
    )  # fmt: skip
    objective = (out.logprobs * problem.grad_logprob.to(DEVICE)).sum()
    objective = objective + (out.entropy * problem.grad_entropy.to(DEVICE)).sum()
    grads = torch.autograd.grad(objective, (hidden, weight, bias))
    return (out.logprobs, out.entropy, *grads)


@pytest.mark.parametrize("chunk_size", [None, 8])
@pytest.mark.parametrize("dtypes", [DTYPES["fp32"], DTYPES["bf16"]], ids=["fp32", "bf16"])
def test_torch_backend_kept_equals_recomputed_bit_for_bit(dtypes, chunk_size):
    # The torch backend rounds its logits to weight's dtype on either path: keeping them changes
    # which GEMM call produced them, not their values.
    problem = core_problem(T, H, V, seed=11, dtypes=dtypes, upstream="random")
    recomputed = _token_run(problem, "torch", 0, chunk_size=chunk_size)
    kept = _token_run(problem, "torch", T * V * 8, chunk_size=chunk_size)
    for a, b in zip(kept, recomputed, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtypes", KEPT_DTYPES.values(), ids=KEPT_DTYPES.keys())
def test_kept_route_matches_the_reference(backend, dtypes):
    problem = core_problem(T, H, V, seed=12, dtypes=dtypes, upstream="random")
    hidden, weight, bias, targets = _leaves(problem, "cpu")
    options = lce.LogitOptions(**OPTIONS)
    upstream = Upstream(problem.grad_logprob, problem.grad_entropy)
    args = (hidden.detach(), weight.detach(), targets)
    kwargs = dict(ignore_index=-100, options=options, upstream=upstream, bias=bias.detach())
    ref, base = reference(*args, **kwargs), baseline(*args, **kwargs)
    got = _token_run(problem, backend, _budget(hidden, weight))
    names = ("logprobs", "entropy", "grad_hidden", "grad_weight", "grad_bias")
    triples = {
        name: (value.cpu(), getattr(ref, name), getattr(base, name))
        for name, value in zip(names, got, strict=True)
    }
    assert_within_tolerance(triples, *dtypes)


BOTH = Wanted(True, True)


def _saved_count(hidden, weight, budget, route="tokens", wanted=BOTH):
    size = (hidden.shape[0], weight.shape[0], weight.element_size())
    keep = keeps_logits(route, wanted, *size, budget)
    targets = torch.zeros(hidden.shape[0], dtype=torch.long)
    call = encode_call(Call(route, LCEOptions(backend="torch"), wanted=wanted, keep_logits=keep))
    return len(torch.ops.lce.fused(hidden, weight, None, targets, call))


def test_the_budget_keeps_exactly_this_ranks_logits():
    hidden, weight = torch.randn(T, H), torch.randn(V, H)
    need = _budget(hidden, weight)
    assert _saved_count(hidden, weight, need) == 5  # outputs, ids, statistics, the logits
    assert _saved_count(hidden, weight, need - 1) == 4
    assert _saved_count(hidden, weight, 0) == 4
    assert _saved_count(hidden, weight, need, route="loss") == 5
    assert _saved_count(hidden, weight, need, wanted=Wanted(False, False)) == 4  # no backward


def test_kept_logits_are_not_recomputed_and_survive_a_second_backward():
    """The forward's GEMMs alone compute logits (into the kept buffer); two backwards
    (retain_graph) agree exactly."""
    problem = core_problem(T, H, V, seed=13, upstream="random")
    hidden, weight, bias, targets = _leaves(problem, "cpu")
    with logit_rows_computed() as rows:
        loss = lce.linear_cross_entropy(
            hidden, weight, targets, bias=bias, backend="torch", chunk_size=8,
            label_smoothing=0.1, z_loss=1e-3, keep_logits_bytes=_budget(hidden, weight),
            **OPTIONS,
        )  # fmt: skip
        assert rows == {"_logits": 0, "_kept_dots": T}  # every token's logits once, kept
        first = torch.autograd.grad(loss, (hidden, weight, bias), retain_graph=True)
        second = torch.autograd.grad(loss, (hidden, weight, bias))
        assert rows == {"_logits": 0, "_kept_dots": T}  # no backward recomputed them
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b) and a.abs().sum() > 0


@pytest.mark.parametrize("route", [{"fast": True}, {"grad_weight_into": "buffer"}])
def test_the_3_gemm_loss_paths_keep_nothing(route):
    hidden, weight = torch.randn(T, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    targets = torch.randint(0, V, (T,))
    kwargs = {k: torch.zeros(V, H) if v == "buffer" else v for k, v in route.items()}
    expected = lce.linear_cross_entropy(hidden, weight, targets, backend="torch", **kwargs)
    got = lce.linear_cross_entropy(
        hidden, weight, targets, backend="torch", keep_logits_bytes=1 << 40, **kwargs
    )
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [(-1, ValueError, "keep_logits_bytes must be >= 0"), (1.5, TypeError, "keep_logits_bytes")],
)
def test_a_bad_budget_names_the_argument(value, error, match):
    hidden, weight = torch.randn(T, H), torch.randn(V, H)
    with pytest.raises(error, match=match):
        targets = torch.zeros(T, dtype=torch.long)
        lce.token_logprobs(hidden, weight, targets, keep_logits_bytes=value)


def test_a_budget_from_a_symbolic_token_count_compiles():
    """Found by the harness's compiled property on an H100: a budget computed from the inputs'
    shape is symbolic once Dynamo makes the token count dynamic, and it used to travel in the op's
    call string (a graph constant), which Dynamo cannot write (a graph break under fullgraph)."""
    weight = torch.randn(V, H, requires_grad=True)

    def step(hidden, targets):
        budget = hidden.shape[0] * weight.shape[0] * weight.element_size()
        out = lce.token_logprobs(hidden, weight, targets, backend="torch", keep_logits_bytes=budget)
        return (out.logprobs * torch.arange(hidden.shape[0])).sum() + out.entropy.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for tokens in (5, 7, 9):  # the second size makes the token count dynamic
        hidden = torch.randn(tokens, H, requires_grad=True)
        targets = torch.randint(0, V, (tokens,))
        got = torch.autograd.grad(compiled(hidden, targets), (hidden, weight))
        expected = torch.autograd.grad(step(hidden, targets), (hidden, weight))
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("chunk_size", [None, 8])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_last_backward_may_write_over_the_kept_logits(backend, chunk_size, monkeypatch):
    """A backward that retains the graph reads the kept logits and leaves them as they were; the
    last one (the engine frees its saved tensors after it) is told it may write its d_logits
    over them, which the Triton stage does (no d_logits buffer of its own). Both give the same
    bits, and a second backward sees the first one's logits intact."""
    problem = core_problem(T, H, V, seed=14, dtypes=DTYPES["fp32"], upstream="random")
    hidden, weight, bias, targets = _leaves(problem)
    told, in_place = [], []
    stage_class = _stage_class(backend)
    stage_backward = stage_class.backward_grads

    def spy_backward(self, *args, **kwargs):
        told.append(kwargs.get("kept_writable"))
        return stage_backward(self, *args, **kwargs)

    monkeypatch.setattr(stage_class, "backward_grads", spy_backward)
    if backend == "triton":
        triton_stages = importlib.import_module("lce.backends.triton.stages")
        row_dlogits = triton_stages.row_dlogits

        def spy_rows(logits, out, *args, **kwargs):
            in_place.append(out.data_ptr() == logits.data_ptr())
            return row_dlogits(logits, out, *args, **kwargs)

        monkeypatch.setattr(triton_stages, "row_dlogits", spy_rows)
    out = lce.token_logprobs(
        hidden, weight, targets, bias=bias, backend=backend, chunk_size=chunk_size,
        keep_logits_bytes=_budget(hidden, weight), **OPTIONS,
    )  # fmt: skip
    objective = (out.logprobs * problem.grad_logprob.to(DEVICE)).sum()
    objective = objective + (out.entropy * problem.grad_entropy.to(DEVICE)).sum()
    first = torch.autograd.grad(objective, (hidden, weight, bias), retain_graph=True)
    assert told == [False] and not any(in_place)
    second = torch.autograd.grad(objective, (hidden, weight, bias))
    assert told == [False, True]
    if backend == "triton":
        blocks = 1 if chunk_size is None else -(-T // chunk_size)
        assert in_place == [False] * blocks + [True] * blocks
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b) and a.abs().sum() > 0


def _stage_class(backend: str) -> type:
    if backend == "torch":
        return TorchChunkedStages
    return importlib.import_module("lce.backends.triton").TritonStages


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_direct_call_of_the_backward_op_leaves_the_kept_logits_as_they_were(backend):
    """Outside the autograd engine's backward (a test, an op check) no one says the kept logits
    are free: the backward op only reads them."""
    hidden, weight = torch.randn(T, H, device=DEVICE), torch.randn(V, H, device=DEVICE)
    targets = torch.randint(0, V, (T,), device=DEVICE)
    options = LCEOptions(backend=backend)
    call = encode_call(Call("tokens", options, wanted=BOTH, keep_logits=True))
    *_, ids, stats, kept = torch.ops.lce.fused(hidden, weight, None, targets, call)
    before = kept.clone()
    upstream = [torch.randn(T, device=DEVICE), torch.randn(T, device=DEVICE)]
    torch.ops.lce.fused_backward(hidden, weight, None, targets, [ids, stats, kept], upstream, call)
    assert torch.equal(kept, before)
