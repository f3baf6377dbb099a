"""A search that finds several distinct failures keeps every one of them.

Hypothesis raises an exception group when explicit examples fail or when it finds distinct bugs
(by exception type and place). Each leaf comes back on its own spec: property failures with their
verdicts, any other exception as an error of its own; the campaign saves one artifact each and
the adapter check reports one failure each (it used to keep one message, "ExceptionGroup:
Hypothesis found 2 distinct failures", on one spec, and drop the verdicts).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st

from tests.third_party_broken_impl import PAIRED_ROWS
from verify.adapters import check_impl
from verify.cases.spec import CaseSpec
from verify.execution.builtin import flat_loss_adapter
from verify.execution.runner import Runner
from verify.properties.verdict import HARNESS
from verify.running import campaign, mutants
from verify.running.engine import check_case, run_property
from verify.running.progress import Progress

pytest_plugins = ["pytester"]

MUTANT = "odd_rows_raise"


class _OddRowsRaise(mutants.MutantStages):
    """Raises AttributeError on an odd row count (as 1501560's mutants did where their wrapper hid
    a stage attribute), and doubles every row's softmax sum on an even one (log-probs off by
    log 2)."""

    def forward_stats(self, hidden, weight, *args):
        if hidden.shape[0] % 2:
            raise AttributeError("planted: odd row counts reach a hidden stage attribute")
        stats = self.inner.forward_stats(hidden, weight, *args)
        return replace(stats, sumexp_nonmax=2.0 * stats.sumexp_nonmax + 1.0)


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> str:
    """`MUTANT` registered for this test (a campaign validates the name)."""
    bug = "raises on odd row counts, log-probs off by log 2 on even ones"
    mutant = mutants.Mutant(MUTANT, bug, mutants._wrap_stages(_OddRowsRaise), backends=("torch",))
    monkeypatch.setitem(mutants.MUTANTS, MUTANT, mutant)
    return MUTANT


def _rerun(record: dict) -> list | Exception:
    """The failing verdicts of an artifact's spec with `MUTANT` planted, or what it raised."""
    spec = CaseSpec.from_json(json.dumps(record["spec"]))
    try:
        verdicts = check_case(spec, properties=["differential"], runner=Runner(mutant=MUTANT))
    except AttributeError as exc:
        return exc
    return [v for v in verdicts if v.failed]


def test_explicit_examples_failing_and_raising_both_come_back(planted: str) -> None:
    failing, raising = CaseSpec(tokens=4, vocab=5), CaseSpec(tokens=3, vocab=5)
    result = run_property(
        "differential", strategy=st.just(CaseSpec(tokens=2, vocab=5)),
        runner=Runner(mutant=planted), max_examples=1, examples=[failing, raising],
    )  # fmt: skip
    assert not result.passed and result.other_failures == []
    assert {v.spec for v in result.failure} == {failing.to_json()}
    assert "logprobs" in {v.output for v in result.failure}  # the numerical verdicts survive
    assert min(v.ratio for v in result.failure) > 1.0
    ((spec, exc),) = result.errors
    assert spec == raising and isinstance(exc, AttributeError)


def test_a_flaky_failure_keeps_its_verdicts_marked() -> None:
    """A kernel wrong on its first call per input only: the search's replay passes, Hypothesis
    raises FlakyFailure (an exception group); its verdicts come back marked, nothing raises."""
    seen = set()

    def first_call_wrong(hidden, weight, targets, ignore_index, reduction):
        key = (reduction, hidden.detach().numpy().tobytes(), targets.numpy().tobytes())
        wrong = key not in seen
        seen.add(key)
        loss = torch.nn.functional.cross_entropy(
            (hidden @ weight.T).float(), targets, reduction=reduction, ignore_index=ignore_index
        )
        return loss * 1.5 if wrong else loss

    adapter = flat_loss_adapter("first_call_wrong", first_call_wrong)
    runner = Runner(adapter=adapter, cache_size=0)  # each property run calls the kernel again
    spec = CaseSpec(tokens=4, vocab=5, upstream="logprob_only")  # no entropy: it has none
    result = run_property("differential", strategy=st.just(spec), runner=runner, max_examples=2)
    assert result.failure and all(
        "; FLAKY: the same spec then passed" in v.detail for v in result.failure
    )


def test_a_campaign_saves_each_finding_of_a_group(planted: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(campaign, "RESTARTS", 0)  # one search finds both (restarts: 15 s more)
    config = campaign.CampaignConfig(
        backends=("torch",), tp_sizes=(1,), budget_s=120, out_dir=tmp_path,
        properties=("differential",), mutant=planted, max_examples=10,
    )  # fmt: skip
    result = campaign.run_campaign(config, Progress("test", 120, stream=None))
    records = [json.loads(path.read_text()) for path in result.artifacts]
    errors = [r for r in records if r["error"]]
    numerical = [r for r in records if not r["error"]]
    assert errors and numerical, records
    for record in numerical:  # the planted bug's verdicts, on the spec they failed
        failed = [(v["output"], v["measured"]) for v in record["verdicts"] if not v["passed"]]
        assert ("logprobs" in dict(failed)) and failed == [
            (v.output, v.measured) for v in _rerun(record)
        ]
    for record in errors:  # each on the spec it was raised on
        assert record["error"].startswith("AttributeError: planted"), record["error"]
        assert isinstance(_rerun(record), AttributeError)
    assert len(result.report["failures"]) == len(records)


def test_the_adapter_check_reports_each_finding_on_its_own_spec(tmp_path) -> None:
    """PAIRED_ROWS asserts an even row count and keeps its logits in bf16: the landmarks (explicit
    examples; Hypothesis keeps the first of each kind) fail both ways. Each finding is reported
    and saved on its own spec; the assert's is a harness error (the adapter's refusals are
    ValueError only)."""
    report = check_impl(
        PAIRED_ROWS, properties=["differential"], max_examples=1, failures_dir=tmp_path
    )
    (outcome,) = report.outcomes
    (error,) = [f for f in outcome.failures if f.verdicts[0].tier == HARNESS]
    numerical = [f for f in outcome.failures if f.verdicts[0].tier != HARNESS]
    rows = error.spec.num_tokens  # the spec it was raised on: the rows its message names
    assert f"AssertionError: rows are processed in pairs; got {rows}" in error.verdicts[0].detail
    assert numerical and report.implementation_failed
    for failure in numerical:  # the bf16 logits' verdicts survive
        assert failure.spec.num_tokens % 2 == 0
        assert "logprobs" in {v.output for v in failure.verdicts if v.failed}
    assert sorted(tmp_path.glob("*.json")) == sorted(Path(f.artifact) for f in outcome.failures)
    lines = report.failure_lines()  # what the CLI prints and the pytest plugin fails with
    assert len(lines) == sum(len(f.verdicts) for f in outcome.failures)


def test_the_pytest_plugin_fails_with_each_finding(pytester: pytest.Pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["verify.pytest_plugin"]')
    pytester.makepyfile("def test_impl(lce_verify):\n    lce_verify(properties=['differential'])\n")
    impl = "tests.third_party_broken_impl:PAIRED_ROWS"
    result = pytester.runpytest_inprocess("--lce-impl", impl, "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*differential FAILED on logprobs*artifact=*",
            "*differential HARNESS ERROR on harness*AssertionError: rows are processed in pairs*",
        ]
    )
