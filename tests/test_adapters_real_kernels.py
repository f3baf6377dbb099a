"""Adapters shaped like real kernels: per-token outputs only, declared limits, undeclared refusals,
harness errors kept apart from verdicts on the implementation, and the verl kernel's loader."""

from __future__ import annotations

import sys
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import pytest

from tests import materialized_impl
from verify.adapters import Adapter, Call, Capabilities, Limits, check_impl
from verify.adapters.command import run_impl
from verify.adapters.filtering import coerce, not_tested
from verify.cases.spec import CaseSpec
from verify.cli import EXIT_HARNESS
from verify.properties import catalog
from verify.properties.verdict import HARNESS

# Small searches: the landmarks (one spec per input class) plus a few drawn examples per property.
FEW = {"profile": "ci", "max_examples": 3}


@pytest.mark.parametrize("outputs", materialized_impl.OUTPUT_SUBSETS, ids="+".join)
def test_every_property_runs_or_is_skipped_for_every_output_subset(outputs) -> None:
    """A correct implementation computing any allowed subset of outputs passes: no property
    raises (before: ``KeyError: 'loss_grad_weight'`` in tied_untied for per-token-only ones), and
    each property either ran with verdicts or is listed under "not tested" with its reason."""
    report = check_impl(materialized_impl.adapter(outputs), **FEW)
    assert report.passed and not report.harness_errors, "\n".join(report.failure_lines())
    ran = {o.property for o in report.outcomes if not o.vacuous}
    skipped = {u.what.removeprefix("property ") for u in report.untested}
    assert set(catalog.PROPERTIES) <= ran | skipped, set(catalog.PROPERTIES) - ran - skipped
    assert "differential" in ran and "tied_untied" in ran


def test_per_token_only_adapter_passes_the_ci_profile() -> None:
    report = check_impl("tests.materialized_impl:per_token_only", profile="ci")
    assert report.passed and not report.harness_errors, "\n".join(report.failure_lines())
    assert {"entropy_targets", "tied_untied", "upstream_linearity"} <= {
        o.property for o in report.outcomes if o.examples > 0
    }
    assert "property torch_peer: no loss output" in {u.line() for u in report.untested}


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
    adapter = materialized_impl.adapter(("logprobs", "entropy"))
    names = ["differential", "tied_untied", "entropy_targets"]
    report = check_impl(adapter, properties=names, failures_dir=tmp_path, **FEW)
    (error,) = report.harness_errors
    assert error.property == "tied_untied" and error.tier == HARNESS
    assert "ZeroDivisionError: planted harness bug" in error.detail
    assert "_raise_on_tied" in error.traceback  # where the harness raised
    assert CaseSpec.from_json(error.spec).tied  # shrunk to a case that triggers it
    ran = {o.property: o for o in report.outcomes}
    assert ran["differential"].passed and ran["entropy_targets"].passed
    assert ran["differential"].examples > 0 and ran["entropy_targets"].examples > 0


def test_harness_error_has_its_own_exit_code(monkeypatch, tmp_path: Path) -> None:
    planted = replace(catalog.PROPERTIES["tied_untied"], check=_raise_on_tied)
    monkeypatch.setitem(catalog.PROPERTIES, "tied_untied", planted)
    args = Namespace(
        impl="tests.materialized_impl:per_token_only", out=tmp_path, tp=[1], device="cpu",
        profile="ci", properties=["tied_untied"], max_examples=3, budget_s=60.0, failures=None,
        seed=0,
    )  # fmt: skip
    assert run_impl(args) == EXIT_HARNESS


class _Recorder:
    """A correct per-token kernel that asserts its limits like real kernels do, and records
    every hidden size and token count it was called with."""

    def __init__(self, hidden_multiple: int = 128, min_tokens: int = 2) -> None:
        self.hidden_multiple, self.min_tokens = hidden_multiple, min_tokens
        self.calls: list[tuple[int, int]] = []

    def __call__(self, call: Call) -> dict:
        size, rows = call.hidden.shape[-1], call.targets.numel()
        self.calls.append((size, rows))
        assert size % self.hidden_multiple == 0, f"hidden_size {size} % 128"
        assert rows >= self.min_tokens, f"{rows} tokens"
        return materialized_impl.token_outputs(call)


def test_declared_limits_are_never_called_outside_and_are_listed() -> None:
    kernel = _Recorder()
    limits = Limits(hidden_multiple=128, min_tokens=2)
    caps = Capabilities(deterministic=True, limits=limits)
    adapter = Adapter("limited", ("logprobs", "entropy"), kernel, capabilities=caps)
    report = check_impl(adapter, **FEW)
    assert report.passed, "\n".join(report.failure_lines())
    assert kernel.calls and all(h % 128 == 0 and n >= 2 for h, n in kernel.calls)
    assert {h for h, _ in kernel.calls} == {128}
    untested = {u.line() for u in report.untested}
    assert "hidden_size not a multiple of 128: outside the declared limits" in untested
    assert "fewer than 2 tokens: outside the declared limits" in untested


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
    adapter = Adapter("a", ("logprobs",), materialized_impl.token_outputs,
                      capabilities=Capabilities(limits=limits))  # fmt: skip
    assert not limits.violations(coerce(adapter, spec))
    with pytest.raises(ValueError, match="hidden_multiple"):
        Limits(hidden_multiple=0)


def test_undeclared_refusal_is_one_finding_and_the_search_goes_on() -> None:
    """A kernel that refuses inputs under 2 tokens without declaring it: each refusal is reported
    once, with its case, and every property still searches the cases it accepts (before, each
    property shrank to the same refusal)."""
    kernel = _Recorder(hidden_multiple=1, min_tokens=2)
    adapter = Adapter(
        "refuses-one-token", ("logprobs", "entropy"), kernel,
        capabilities=Capabilities(deterministic=True),
    )  # fmt: skip
    report = check_impl(adapter, **FEW)
    failures = [(o.property, f) for o in report.outcomes for f in o.failures]
    # T = 1 and T = 0 (both under 2 tokens), each reported once, by the first property.
    assert 1 <= len(failures) <= 2, report.failure_lines()
    assert len({f.spec.num_tokens for _, f in failures}) == len(failures)
    for _, failure in failures:
        assert failure.refusal and failure.spec.num_tokens < 2
        assert "AssertionError" in failure.verdicts[0].detail
    others = [o for o in report.outcomes if o.property not in {p for p, _ in failures}]
    assert others and all(o.passed and o.examples > 0 for o in others)


def test_refusal_of_the_simplest_case_stops_the_search_once() -> None:
    """An undeclared hidden_size % 128 assertion refuses every generated case: reported once,
    the remaining properties are listed as not run (declare the limit to search)."""
    adapter = Adapter("undeclared", ("logprobs",), _Recorder(min_tokens=0))
    report = check_impl(adapter, **FEW)
    assert sum(len(o.failures) for o in report.outcomes) == 1
    not_run = [u for u in report.untested if "the simplest case was refused" in u.reason]
    assert not_run, report.untested


def test_verl_kernel_loads_without_verl_package_init(monkeypatch) -> None:
    """The real verl kernel modules import with bare ``verl``/``verl.utils`` entries: verl's own
    ``__init__`` (ray, transformers, its trainers) never runs. Needs verl (``pip install --no-deps
    verl`` or ``VERL_PATH``)."""
    from verify.adapters import AdapterError
    from verify.execution import verl_kernel

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
    from verify.adapters import AdapterError
    from verify.execution import builtin

    try:
        adapter = builtin.verl_adapter()
    except AdapterError as exc:  # no verl, or no CUDA
        pytest.skip(str(exc))
    gaps = {u.what for u in not_tested(adapter)}
    assert "hidden_size not a multiple of 128" in gaps and "non-contiguous inputs" in gaps
