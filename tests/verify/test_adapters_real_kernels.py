"""Adapters shaped like real kernels: per-token outputs only, declared limits, undeclared refusals,
harness errors kept apart from verdicts on the implementation, and the verl kernel's loader."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.helpers import materialized_impl
from verify.adapters import Adapter, Capabilities, Limits
from verify.adapters.features import coerce, unclaimed
from verify.cases.spec import CaseSpec
from verify.cli import EXIT_HARNESS, main
from verify.properties import catalog
from verify.running.campaign import run_campaign
from verify.running.config import CampaignConfig

MATERIALIZED = "tests.helpers.materialized_impl"
# Small searches: the landmarks (one spec per input class) plus a few drawn examples.
FEW = {"profile": "ci", "max_examples": 3, "tp_sizes": (1,), "budget_s": 120.0}


def _campaign(tmp_path: Path, impl: str, **fields) -> dict:
    return run_campaign(CampaignConfig(impl=impl, out_dir=tmp_path, **{**FEW, **fields})).report


def _ran(doc: dict) -> set[str]:
    return {row["property"] for row in doc["counts"] if row["examples"] > 0}


def _untested(doc: dict) -> set[str]:
    return {f"{u['what']}: {u['reason']}" for u in doc["not_tested"]}


@pytest.mark.slow
@pytest.mark.parametrize("outputs", materialized_impl.OUTPUT_SUBSETS, ids="+".join)
def test_every_property_runs_or_is_skipped_for_every_output_subset(outputs, tmp_path) -> None:
    """A correct implementation computing any allowed subset of outputs passes: no property
    raises (before: ``KeyError: 'loss_grad_weight'`` in tied_untied for per-token-only ones), and
    each property either ran with verdicts or is listed under "not tested" with its reason."""
    doc = _campaign(tmp_path, materialized_impl.factory_ref(outputs))
    assert doc["passed"], [f["line"] for f in doc["failures"]]
    skipped = {u["what"].removeprefix("property ") for u in doc["not_tested"]}
    assert set(catalog.PROPERTIES) <= _ran(doc) | skipped, set(catalog.PROPERTIES) - skipped
    assert {"differential", "tied_untied"} <= _ran(doc)


@pytest.mark.slow
def test_per_token_only_adapter_passes_the_ci_profile(tmp_path) -> None:
    doc = _campaign(tmp_path, f"{MATERIALIZED}:per_token_only", max_examples=None)
    assert doc["passed"], [f["line"] for f in doc["failures"]]
    assert {"entropy_targets", "tied_untied", "upstream_linearity"} <= _ran(doc)
    assert "property torch_peer: no loss output" in _untested(doc)


def _raise_on_tied(spec, runner):
    """A property whose own code has a bug on tied cases (a harness bug, not a verdict)."""
    if spec.tied:
        raise ZeroDivisionError("planted harness bug")
    return []


def test_harness_error_is_reported_with_its_traceback_and_the_rest_goes_on(
    monkeypatch, tmp_path: Path
) -> None:
    planted = replace(catalog.PROPERTIES["tied_untied"], check=_raise_on_tied)
    monkeypatch.setitem(catalog.PROPERTIES, "tied_untied", planted)
    names = ("differential", "tied_untied", "entropy_targets")
    doc = _campaign(tmp_path, f"{MATERIALIZED}:per_token_only", properties=names)
    (error,) = [f for f in doc["failures"] if f["harness"]]
    assert error["property"] == "tied_untied" and error["tier"] == "harness"
    assert "ZeroDivisionError: planted harness bug" in error["line"]
    (verdict,) = json.loads(Path(error["artifact"]).read_text())["verdicts"]
    assert "_raise_on_tied" in verdict["traceback"]  # where the harness raised
    assert CaseSpec.from_json(json.dumps(_spec(error))).tied  # a case that triggers it
    assert {"differential", "entropy_targets"} <= _ran(doc)
    assert not [f for f in doc["failures"] if not f["harness"]]


def _spec(failure: dict) -> dict:
    return json.loads(Path(failure["artifact"]).read_text())["spec"]


def test_harness_error_has_its_own_exit_code(monkeypatch, tmp_path: Path) -> None:
    planted = replace(catalog.PROPERTIES["tied_untied"], check=_raise_on_tied)
    monkeypatch.setitem(catalog.PROPERTIES, "tied_untied", planted)
    argv = ["run", "--impl", f"{MATERIALIZED}:per_token_only", "--out", str(tmp_path), "--tp", "1",
            "--properties", "tied_untied", "--max-examples", "3", "--budget-s", "60"]  # fmt: skip
    assert main(argv) == EXIT_HARNESS


@pytest.mark.slow
def test_declared_limits_are_never_called_outside_and_are_listed(tmp_path) -> None:
    """The kernel asserts its limits: a call outside them would fail as a refusal."""
    doc = _campaign(tmp_path, f"{MATERIALIZED}:limited")
    assert doc["passed"], [f["line"] for f in doc["failures"]]
    assert doc["examples"] > 0
    untested = _untested(doc)
    assert "hidden_size not a multiple of 128: outside the declared limits" in untested
    assert "fewer than 2 tokens: outside the declared limits" in untested
    assert "token count not a multiple of 2: outside the declared limits" in untested


def test_limits_fit_specs_and_name_violations() -> None:
    limits = Limits(hidden_multiple=128, vocab_multiple=8, min_tokens=3)
    spec = CaseSpec(hidden_size=33, vocab=13, tp=2, tokens=1, batch=2)
    fitted = limits.fit(spec)
    assert (fitted.hidden_size, fitted.vocab, fitted.tokens) == (128, 16, 2)
    assert not limits.violations(fitted)
    assert len(limits.violations(spec)) == 3
    assert Limits(even_shards=True).fit(CaseSpec(vocab=13, tp=4)).vocab == 16
    uneven = CaseSpec(vocab=16, tp=2, shards=(10, 6))  # explicit unequal shards
    assert Limits(even_shards=True).fit(uneven) == uneven.with_(shards=None)
    assert Limits().fit(uneven) is uneven and not Limits().violations(uneven)
    assert Limits(vocab_multiple=2).violations(uneven)  # multiples imply equal shards
    assert Limits().fit(spec) is spec
    # Flattened [batch x tokens] rows: 3 rows of 6 tokens make 18, a multiple of 6 but not of 4.
    batched = CaseSpec(tokens=5, batch=3)
    assert Limits(token_multiple=4).fit(batched).tokens == 8  # 24 rows
    assert Limits(token_multiple=6).fit(batched).tokens == 6
    assert Limits(token_multiple=4).violations(batched) == ["15 tokens % 4 != 0"]
    adapter = Adapter("a", ("logprobs",), materialized_impl.token_outputs,
                      capabilities=Capabilities(limits=limits))  # fmt: skip
    assert not limits.violations(coerce(adapter, spec))
    with pytest.raises(ValueError, match="hidden_multiple"):
        Limits(hidden_multiple=0)


def test_undeclared_refusal_is_one_finding_and_the_search_goes_on(tmp_path) -> None:
    """A kernel that refuses inputs under 2 tokens without declaring it: each refusal is reported
    once, with its case, and the search goes on over the cases it accepts (before, each property
    shrank to the same refusal)."""
    doc = _campaign(tmp_path, f"{MATERIALIZED}:refuses_one_token")
    failures = doc["failures"]
    # T = 1 and T = 0 (both under 2 tokens), each reported once.
    assert 1 <= len(failures) <= 2, [f["line"] for f in failures]
    tokens = {CaseSpec.from_json(json.dumps(_spec(f))).num_tokens for f in failures}
    assert len(tokens) == len(failures) and max(tokens) < 2
    assert all("refused a valid case" in f["line"] and "AssertionError" in f["line"]
               for f in failures)  # fmt: skip
    assert {"differential", "entropy_targets", "upstream_linearity"} <= _ran(doc)


def test_refusal_of_the_simplest_case_stops_the_search_once(tmp_path) -> None:
    """An undeclared hidden_size % 128 assertion refuses every generated case: reported once."""
    doc = _campaign(tmp_path, f"{MATERIALIZED}:undeclared_limit")
    assert len(doc["failures"]) == 1, [f["line"] for f in doc["failures"]]


def test_verl_kernel_loads_without_verl_package_init(monkeypatch) -> None:
    """The real verl kernel modules import with bare ``verl``/``verl.utils`` entries: verl's own
    ``__init__`` (ray, transformers, its trainers) never runs. Needs verl (``pip install --no-deps
    verl`` or ``VERL_PATH``)."""
    from verify.adapters import AdapterError, verl_kernel

    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        module = verl_kernel.load()
    except AdapterError as exc:
        pytest.skip(str(exc))
    assert callable(module.linear_cross_entropy)
    assert sys.modules["verl.utils.kernel.kernels"].efficient_entropy_forward
    assert not hasattr(sys.modules["verl"], "DataProto")  # verl/__init__.py did not run
    assert "ray" not in sys.modules and verl_kernel.version()


def test_verl_adapter_declares_the_kernels_limits() -> None:
    from verify.adapters import AdapterError, builtin

    try:
        adapter = builtin.verl_adapter()
    except AdapterError as exc:  # no verl, or no CUDA
        pytest.skip(str(exc))
    gaps = {u.what for u in unclaimed(adapter, (1,))}
    assert "hidden_size not a multiple of 128" in gaps and "non-contiguous inputs" in gaps
