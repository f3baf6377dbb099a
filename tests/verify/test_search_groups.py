"""A search that finds several distinct failures keeps every one of them.

Hypothesis raises an exception group when explicit examples fail or when it finds distinct bugs
(by exception type and place). Each leaf comes back on its own spec: property failures with their
verdicts, any other exception as an error of its own; the campaign saves one artifact each and
a campaign of another implementation alike (it used to keep one message, "ExceptionGroup:
Hypothesis found 2 distinct failures", on one spec, and drop the verdicts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st

from tests.helpers import planted_mutant
from tests.helpers.planted_mutant import MUTANT
from verify.adapters.builtin import flat_loss_adapter
from verify.cases.spec import CaseSpec
from verify.distributed import WorkerPool
from verify.distributed.seam import CASE_MODULES
from verify.execution import mutants
from verify.execution.runner import Runner
from verify.running import campaign, search
from verify.running.config import CampaignConfig
from verify.running.engine import check_case, run_property
from verify.running.progress import Progress

pytest_plugins = ["pytester"]

PAIRED_ROWS_REF = "tests.helpers.third_party_broken_impl:PAIRED_ROWS"
WORKER_MUTANT = ("tests.helpers.planted_mutant_worker",)  # a pool's workers know MUTANT


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> str:
    """`MUTANT` registered for this test (a campaign validates the name)."""
    monkeypatch.setitem(mutants.MUTANTS, MUTANT, planted_mutant.mutant())
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

    def first_call_wrong(call, reduction):
        key = (reduction, call.hidden.detach().numpy().tobytes(), call.targets.numpy().tobytes())
        wrong = key not in seen
        seen.add(key)
        logits = (call.hidden @ call.weight.T).float()
        loss = torch.nn.functional.cross_entropy(
            logits, call.targets, reduction=reduction, ignore_index=call.ignore_index
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
    monkeypatch.setattr(search, "RESTARTS", 0)  # one search finds both (restarts: 15 s more)
    config = CampaignConfig(
        impl="lce-torch", tp_sizes=(1,), budget_s=120, out_dir=tmp_path,
        properties=("differential",), mutant=planted, max_examples=10,
    )  # fmt: skip
    with WorkerPool(world_size=1, preload=(*CASE_MODULES, *WORKER_MUTANT)) as pool:
        result = campaign.run_campaign(config, Progress("test", 120, stream=None), pool=pool)
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


def test_a_campaign_of_another_kernel_reports_each_finding_on_its_own_spec(tmp_path) -> None:
    """PAIRED_ROWS asserts an even row count and keeps its logits in bf16: the landmarks (explicit
    examples; Hypothesis keeps the first of each kind) fail both ways. Each finding is reported
    and saved on its own spec; the assert's is the implementation raising an exception outside
    its refusals (ValueError only): an error artifact, a failure of the implementation."""
    config = CampaignConfig(
        impl=PAIRED_ROWS_REF, tp_sizes=(1,), budget_s=120, out_dir=tmp_path,
        properties=("differential",), max_examples=1,
    )  # fmt: skip
    doc = campaign.run_campaign(config, Progress("test", 120, stream=None)).report
    records = {f["artifact"]: json.loads(Path(f["artifact"]).read_text()) for f in doc["failures"]}
    errors = [r for r in records.values() if r["error"]]
    numerical = [r for r in records.values() if not r["error"]]
    assert errors  # one per message: the covering rows reach several odd row counts
    for error in errors:
        rows = CaseSpec.from_json(json.dumps(error["spec"])).num_tokens  # the rows it names
        assert f"AssertionError: rows are processed in pairs; got {rows}" in error["error"]
    assert numerical and doc["outcome"] == "failed"
    for record in numerical:  # the bf16 logits' verdicts survive
        assert CaseSpec.from_json(json.dumps(record["spec"])).num_tokens % 2 == 0
        assert "logprobs" in {v["output"] for v in record["verdicts"] if not v["passed"]}
    assert sorted((tmp_path / "failures").glob("*.json")) == sorted(map(Path, records))


def test_the_pytest_plugin_fails_with_each_finding(pytester: pytest.Pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["verify.pytest_plugin"]')
    pytester.makepyfile("def test_impl(lce_verify):\n    lce_verify(properties=['differential'])\n")
    impl = PAIRED_ROWS_REF
    result = pytester.runpytest_inprocess("--lce-impl", impl, "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*differential FAILED on *artifact=*",
            "*AssertionError: rows are processed in pairs*artifact=*",
        ]
    )
