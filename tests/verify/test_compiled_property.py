"""The compiled and graph_replay properties: lce passes the first on its torch backend (the ci
campaign runs it), a fake implementation that disagrees with its op fails it, an implementation
that claims neither gets both listed as not tested, and graph_replay adds nothing off CUDA."""

from __future__ import annotations

import copy
import json
import shlex

import pytest
import torch

import lce.ops
from verify.adapters.registry import from_loss_fn, resolve
from verify.cases.spec import CaseSpec
from verify.cli import EXIT_PASS, main
from verify.execution.execute import LocalRank, execute
from verify.properties import compiled
from verify.properties.catalog import applicable
from verify.properties.graph_replay import check_replay
from verify.running.engine import check_case

# Batched (hidden [B, T, H]), every logit option, bf16: the shapes and dtypes a fake
# implementation must get right; a per-token loss; a mean over random ignored tokens.
SPECS = [
    CaseSpec(tokens=7, vocab=11, seed=5, batch=2, reduction="mean", softcap=5.0, z_loss=0.01,
             label_smoothing=0.1, bias=0.5, hidden_dtype="bf16", weight_dtype="bf16"),
    CaseSpec(tokens=5, vocab=17, seed=3, ignore="random", reduction="none"),
]  # fmt: skip


@pytest.mark.parametrize("spec", SPECS, ids=["batched-options-bf16", "per-token"])
def test_lce_compiles_and_passes(spec):
    verdicts = check_case(spec, properties=["compiled"])
    assert verdicts and all(v.passed for v in verdicts), [v.line() for v in verdicts]
    (outputs,) = [v for v in verdicts if v.output == "outputs"]
    # lce's op is opaque to the compiler: every output equal to eager's, bit for bit.
    assert "grad_hidden" in outputs.detail and "bit-equal to eager: ['entropy'," in outputs.detail


def test_a_fake_implementation_that_drops_the_batch_dims_fails(monkeypatch):
    """The backward op's fake implementation gives grad_hidden as ``[B*T, H]``: eager never runs
    it, so only the compiled run can catch it."""
    original = lce.ops.fake_grads

    def flattened(hidden, weight, call):
        grads = original(hidden, weight, call)
        if call.wanted.hidden and hidden.dim() == 3:
            grads[0] = grads[0].reshape(-1, hidden.shape[-1])
        return grads

    torch._dynamo.reset()  # graphs compiled with the right fake would hide the bug
    monkeypatch.setattr(compiled, "_COMPILED", {})
    monkeypatch.setattr(lce.ops, "fake_grads", flattened)
    try:
        verdicts = check_case(SPECS[0], properties=["compiled"])
    finally:
        torch._dynamo.reset()
    failed = [v for v in verdicts if not v.passed]
    assert [v.output for v in failed] == ["status"], [v.line() for v in verdicts]
    assert "under torch.compile" in failed[0].detail
    assert check_case(SPECS[0], properties=["differential"])  # eager still runs it


def test_a_size_dependent_bug_fails_on_a_fresh_cache(monkeypatch):
    """A bug that shows only under symbolic sizes fails on the case itself, not only after an
    earlier example of another size made Dynamo's graph dynamic: here lce's keep decision
    returned as a comparison (symbolic under compile, so it cannot be written into the op's call
    text), as 2960a6a's first version did. Every size is marked dynamic, so the verdict, and the
    artifact's replay in a fresh process, depend on the case alone."""
    import lce.api

    def symbolic(route, wanted, tokens, vocab_local, itemsize, budget):
        return route in ("tokens", "loss") and tokens * vocab_local * itemsize <= budget

    spec = CaseSpec(tokens=5, vocab=13, seed=1, loss_path="kept_logits", upstream="random")
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "_COMPILED", {})
    monkeypatch.setattr(lce.api, "keeps_logits", symbolic)
    try:
        verdicts = check_case(spec, properties=["compiled"])  # the first example compiled
    finally:
        torch._dynamo.reset()
    failed = [v for v in verdicts if not v.passed]
    assert [v.output for v in failed] == ["status"], [v.line() for v in verdicts]
    assert "under torch.compile" in failed[0].detail


def _materialized_loss(hidden, weight, targets, *, reduction="mean"):
    return torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction=reduction)


def test_an_implementation_claiming_neither_has_both_listed_as_not_tested():
    _, untested = applicable(from_loss_fn(_materialized_loss), (1,))
    reasons = {u.what: u.reason for u in untested}
    assert reasons["property compiled"] == "torch.compile support not claimed"
    assert reasons["property graph_replay"] == "CUDA-graph capture not claimed"


@pytest.mark.skipif(
    not hasattr(torch.nn.functional, "linear_cross_entropy"), reason="the torch peer needs 2.13"
)
def test_the_torch_peer_claims_compile_and_not_graph_capture():
    _, untested = applicable(resolve("torch"), (1,))
    reasons = {u.what: u.reason for u in untested}
    assert "property compiled" not in reasons
    assert reasons["property graph_replay"] == "CUDA-graph capture not claimed"


def test_graph_replay_adds_no_verdict_off_cuda():
    # A CPU campaign on a CUDA host (the GPU nightly's seeded campaigns) listed graph_replay's
    # pairs as "not reached in budget" (0 / 269): the workers' device decides, not the host's.
    adapter = resolve("lce-torch")
    assert check_replay(SPECS[1], adapter, None, LocalRank(torch.device("cpu"))) == []
    _, untested = applicable(adapter, (1,), device="cpu")
    reasons = {u.what: u.reason for u in untested}
    assert "--device cuda" in reasons["property graph_replay"]
    names, _ = applicable(adapter, (1,), device="cuda")
    assert "graph_replay" in names


def test_a_missing_peer_package_is_not_tested_not_a_pass(monkeypatch):
    # PyTorch 2.11 (the GPU image) has no F.linear_cross_entropy: torch_peer showed "0 / 0
    # (100%)" of its pairs. Now it is listed as not tested, with the reason; megatron-core alike.
    from verify.properties import peers

    monkeypatch.setattr(peers, "torch_has_peer", lambda: False)
    monkeypatch.setattr(peers, "megatron_installed", lambda: False)
    names, untested = applicable(resolve("lce-torch"), (1, 2))
    reasons = {u.what: u.reason for u in untested}
    assert "torch_peer" not in names and "megatron_peer" not in names
    assert "linear_cross_entropy" in reasons["property torch_peer"]
    assert "megatron-core" in reasons["property megatron_peer"]


def test_the_ci_campaign_runs_compiled_on_the_torch_backend(tmp_path, capsys):
    out = tmp_path / "report"
    # Bounded by a budget: each new dtype, option set or layout recompiles (about a second).
    argv = shlex.split("run --profile ci --backends torch --tp 1 --budget-s 12")
    argv += ["--properties", "compiled", "--out", str(out)]
    assert main(argv) == EXIT_PASS, capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    counts = [c for c in report["counts"] if c["property"] == "compiled"]
    assert counts and report["passed"] and report["examples"] >= 2


def test_the_lce_adapter_calls_lce_without_a_deepcopy(monkeypatch):
    """The compiled property traces the adapter's callables with fullgraph: Dynamo before torch
    2.13 cannot trace ``copy.deepcopy`` (which ``dataclasses.asdict`` makes of every value), so
    the adapter's options read through asdict failed every compiled case on the GPU image's
    torch 2.11 (the ci campaign test there)."""

    def refuse(value, memo=None):
        raise AssertionError(f"copy.deepcopy({value!r}) on the adapter's call path")

    monkeypatch.setattr(copy, "deepcopy", refuse)
    spec = SPECS[0]
    result = execute(spec, LocalRank(torch.device("cpu")), resolve("lce-torch"))
    assert result["status"] == "ok" and {"logprobs", "loss"} <= set(result)


@torch.compile(fullgraph=True, dynamic=True, backend="eager")
def _compiled_inside(hidden, weight, targets, *, reduction="mean", ignore_index=-100):
    """A loss compiled inside its own function, as CCE's impl='torch_compile' is."""
    logits = (hidden @ weight.T).float()
    return torch.nn.functional.cross_entropy(
        logits, targets, ignore_index=ignore_index, reduction=reduction
    )


def test_a_recompile_limit_met_inside_an_implementation_gives_a_fresh_process_verdict(monkeypatch):
    """One Dynamo cache per code object and process: a worker that has run other dtypes and
    reductions through such an implementation meets the limit, which under ``fullgraph=True``
    raises; a fresh process replaying the case would not, so the run starts a fresh cache."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)  # what one case needs
    torch._dynamo.reset()
    adapter = from_loss_fn(_compiled_inside)
    first = CaseSpec(tokens=5, vocab=7, seed=1, reduction="none")
    second = CaseSpec(tokens=6, vocab=9, seed=2, reduction="mean", hidden_dtype="fp32")
    local = LocalRank(torch.device("cpu"))
    assert execute(first, local, adapter).get("status", "ok") == "ok"
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # fill the cache
        for dtype in (torch.float64, torch.bfloat16, torch.float16):
            weight = torch.ones(4, 3, dtype=dtype)
            _compiled_inside(weight[:2], weight, torch.zeros(2, dtype=torch.long))
    result = execute(second, local, adapter)
    assert result.get("status", "ok") == "ok", result
    assert set(result) >= {"loss", "grad_hidden", "grad_weight"}
