"""`Runner`'s rerun of a case that timed out: on fresh workers under a longer deadline (a slow first
call answers then, a hang does not), confirmed as a hang only when that one passes too, and
recorded with the deadline it was confirmed under. A scripted pool stands in for the workers'
timeouts; `test_campaign_faults` and `test_crash_and_hang` run real ones."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

from verify.cases.spec import CaseSpec
from verify.distributed.errors import WorkerHung
from verify.execution.deadline import RERUN_FACTOR, ExampleDeadline
from verify.execution.runner import ImplementationFault, Runner
from verify.results import artifacts
from verify.running.replay import replay_deadline

JOB = "scripted:job"  # never imported: the scripted pool answers for it
SPEC = CaseSpec(tokens=2, vocab=3)


class ScriptedPool:
    """Times out the first ``timeouts`` jobs, then answers; records each job's timeout."""

    device = "cpu"
    tp_sizes = (1,)

    def __init__(self, timeouts: int) -> None:
        self.timeouts, self.given = timeouts, []

    def run(self, job: str, payload: Any, *, tp: int, timeout_s: float) -> list[str]:
        self.given.append(timeout_s)
        if len(self.given) <= self.timeouts:
            raise WorkerHung(ranks=[0], answered=[], timeout_s=timeout_s, job=job, payload=payload)
        return ["answered"]

    def reset(self) -> None:
        """Fresh workers (nothing to do here)."""


def _runner(pool: ScriptedPool, deadline: ExampleDeadline, faults: list[str]) -> Runner:
    return Runner(pool, deadline=deadline, on_fault=faults.append)  # type: ignore[arg-type]


def _unused() -> list[Any]:
    raise AssertionError("a runner with a pool runs nothing here")


def test_a_timeout_whose_longer_rerun_answers_is_the_machines() -> None:
    faults: list[str] = []
    pool = ScriptedPool(timeouts=1)
    results = _runner(pool, ExampleDeadline(60.0), faults).run_job(JOB, {}, SPEC, _unused)
    assert results == ["answered"]
    assert pool.given == [60.0, RERUN_FACTOR * 60.0]
    (fault,) = faults
    assert fault.startswith("no answer within 60 s; the rerun passed; spec {")


def test_a_hang_is_confirmed_under_the_longer_rerun_and_recorded_under_the_rule() -> None:
    deadline = ExampleDeadline(60.0)
    deadline.observe(12.0)  # a slow healthy example: the rule's deadline is now 120 s
    pool = ScriptedPool(timeouts=2)
    runner = _runner(pool, deadline, [])
    with pytest.raises(ImplementationFault) as info:
        runner.run_job(JOB, {}, SPEC, _unused)
    assert info.value.kind == "hang" and pool.given == [120.0, RERUN_FACTOR * 120.0]
    assert info.value.detail == "no answer within 120 s; again: no answer within 600 s"
    assert runner.fault_deadline_s == 120.0  # what a replay takes as its floor
    deadline.observe(30.0)  # later examples grow the deadline; the record stays
    assert runner.fault_deadline_s == 120.0


def test_the_rerun_ends_within_the_search_plus_one_deadline() -> None:
    pool = ScriptedPool(timeouts=1)
    runner = _runner(pool, ExampleDeadline(60.0), [])
    runner.new_search(stop_at=time.monotonic() + 30.0)
    runner.run_job(JOB, {}, SPEC, _unused)
    assert pool.given[0] == 60.0 and 60.0 < pool.given[1] <= 90.0


def test_a_rerun_after_a_hang_gets_longer_within_the_search():
    deadline = ExampleDeadline(4.0)
    assert deadline.rerun_seconds(math.inf) == RERUN_FACTOR * 4.0
    assert deadline.rerun_seconds(6.0) == 10.0  # the search's end plus one deadline
    assert deadline.rerun_seconds(-1.0) == 4.0  # never shorter than a first attempt's
    assert ExampleDeadline(4.0, fixed=True).rerun_seconds(math.inf) == 4.0  # the caller's word


def _replay_deadline(directory: Path, **recorded: Any) -> tuple[dict[str, Any], ExampleDeadline]:
    record = artifacts.make_record(SPEC, "differential", [], shrunk=True, **recorded)
    return record, replay_deadline(artifacts.load(artifacts.write(record, directory)))


def test_a_replay_keeps_the_deadline_its_artifact_was_found_under(tmp_path: Path) -> None:
    """A hang found under a fixed deadline replays under it (no five-fold rerun); one found under
    the rule takes it as its floor; an artifact without a deadline gets the rule."""
    _, fixed = _replay_deadline(tmp_path, example_deadline_s=5.0, example_deadline_fixed=True)
    assert fixed.seconds() == 5.0 and fixed.rerun_seconds(math.inf) == 5.0
    record, ruled = _replay_deadline(tmp_path, example_deadline_s=5.0)
    assert "example_deadline_fixed" not in record  # the key is written only where true
    assert ruled.seconds() == 5.0 and ruled.rerun_seconds(math.inf) == RERUN_FACTOR * 5.0
    _, default = _replay_deadline(tmp_path)
    assert default.seconds() == ExampleDeadline().seconds() and not default.fixed
