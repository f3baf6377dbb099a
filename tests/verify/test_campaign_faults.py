"""A campaign's faults are not the implementation's: a worker SIGKILLed from outside mid-job, at
TP 1 and 2, is an infrastructure error (rank and spec reported, the case rerun once on fresh
workers, which passes: no failure artifact, exit code `EXIT_INFRA`), and so is a first call slower
than the per-example deadline (a JIT compile) whose rerun answers within the rerun's longer one;
SIGINT and SIGTERM stop the pool and write the report so far, marked interrupted, with one line to
the terminal and exit 130 / 143."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.campaign_jobs import SLOW_FIRST_S, STALL_FILE
from verify.cases.spec import CaseSpec
from verify.cli import EXIT_HARNESS, EXIT_INFRA, EXIT_SIGNAL, campaign_exit_code
from verify.distributed import WorkerPool
from verify.running import profiles
from verify.running.campaign import run_campaign
from verify.running.config import CampaignConfig
from verify.running.progress import Progress


def _kill_when_stalled(path: Path, timeout_s: float = 120.0) -> threading.Thread:
    """SIGKILL the pid that `tests.helpers.campaign_jobs.stall_once` writes to ``path``, once
    it does."""

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if path.exists():
            os.kill(int(path.read_text()), signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("tp", [1, 2])
def test_a_worker_killed_mid_job_is_an_infrastructure_error(tp, tmp_path, monkeypatch):
    from verify.execution import execute

    stall = tmp_path / "stalled.pid"
    monkeypatch.setenv(STALL_FILE, str(stall))  # before the pool starts: workers inherit it
    monkeypatch.setattr(execute, "CASE_JOB", "tests.helpers.campaign_jobs:stall_once")
    config = CampaignConfig(
        impl="lce-torch",
        tp_sizes=(tp,),
        budget_s=120,
        out_dir=tmp_path / "out",
        properties=("differential",),
        max_examples=4,
    )
    with WorkerPool(world_size=tp, timeout_s=60) as pool:
        killer = _kill_when_stalled(stall)
        result = run_campaign(config, Progress("test", 120, stream=None), pool=pool)
        killer.join()
        assert pool.starts == 2  # rebuilt once after the kill
    killed_pid = stall.read_text()
    doc = result.report
    assert doc["failures"] == [] and result.artifacts == []  # lce is not blamed
    assert not list((tmp_path / "out").rglob("*.json"))[1:]  # report.json alone
    (error,) = doc["errors"]
    assert error["where"] == f"lce-torch TP={tp}"
    message = error["message"]
    assert message.startswith(f"the process of rank {tp - 1} died (killed by SIGKILL)")
    assert "; the rerun passed; spec {" in message
    assert killed_pid and f'"tp":{tp}' in message
    assert doc["slices"][0]["status"] == "done" and doc["examples"] >= 4  # the case ran again
    assert campaign_exit_code(doc) == EXIT_INFRA and doc["outcome"] == "incomplete"
    report = (tmp_path / "out" / "report.md").read_text()
    assert report.startswith("# ci campaign of lce-torch: INCOMPLETE (infrastructure")
    assert "1 infrastructure error(s)" in report


# The deadline's floor here: healthy cases take milliseconds (a 2 s deadline was once met by one
# on 2 loaded cores).
FLOOR_S = 5.0


def test_a_slow_first_call_is_not_a_hang(tmp_path, monkeypatch):
    """Each fresh worker's first case sleeps twice the deadline, as a kernel compiled on its
    first call does: the first attempt times out, the rerun (on a fresh worker, compiling again)
    answers within its longer deadline, so the first timeout is the machine's, never a hang."""
    from verify.execution import execute

    monkeypatch.setenv(SLOW_FIRST_S, str(2 * FLOOR_S))  # before the pool starts
    monkeypatch.setattr(execute, "CASE_JOB", "tests.helpers.campaign_jobs:slow_first_call")
    monkeypatch.setitem(profiles.DEADLINE_FLOORS, "ci", FLOOR_S)
    config = CampaignConfig(
        impl="lce-torch", tp_sizes=(1,), budget_s=60, out_dir=tmp_path / "out",
        properties=("differential",), max_examples=3,
    )  # fmt: skip
    with WorkerPool(world_size=1, timeout_s=60) as pool:
        doc = run_campaign(config, Progress("test", 60, stream=None), pool=pool).report
        assert pool.starts == 2  # rebuilt once, after the first attempt's timeout
    assert doc["failures"] == [], doc["failures"]
    (error,) = doc["errors"]
    assert error["message"].startswith(f"no answer within {FLOOR_S:g} s; the rerun passed")
    assert doc["examples"] >= 3 and campaign_exit_code(doc) == EXIT_INFRA


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_campaign_writes_its_report_so_far(sig, tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "verify", "run", "--profile", "ci", "--backends", "torch",
               "--tp", "1,2", "--budget-s", "300", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # progress lines (every 10 s): wait for examples to run
        found = re.search(r"(\d+) examples", process.stderr.readline())
        if found and int(found.group(1)) > 0:
            break
    process.send_signal(sig)  # mid-campaign: examples ran, more to come
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == EXIT_SIGNAL + sig.value, stdout + stderr
    name = sig.name
    (line,) = stdout.splitlines()  # one line to the terminal
    assert line.startswith(f"ci campaign of lce: INTERRUPTED by {name} after ")
    assert "Traceback" not in stderr and "done" not in stderr
    doc = json.loads((out / "report.json").read_text())
    assert doc["interrupted"] == name and doc["passed"] is False
    # Every slice is listed: those run, the one stopped (if the signal came inside one: it may
    # come between two) and those never begun.
    statuses = [s["status"] for s in doc["slices"]]
    stopped = ("interrupted", "not run (interrupted)")
    assert len(statuses) == 2 and statuses[-1] in stopped, statuses  # torch at TP 1 and 2
    assert doc["examples"] > 0
    assert sum(s["examples"] for s in doc["slices"]) == doc["examples"]
    assert (
        (out / "report.md").read_text().startswith(f"# ci campaign of lce: INTERRUPTED by {name}")
    )


def _interrupt_inside_gc_callback() -> None:
    """SIGINT this process while a garbage-collector callback runs: Python prints the
    KeyboardInterrupt the handler raises there as "Exception ignored" and goes on."""

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the campaign's handler raises KeyboardInterrupt in here

    gc.callbacks.append(on_gc)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(on_gc)


@pytest.mark.parametrize("surfaces_as", ["exception", "result", "ignored"])
def test_an_interrupt_swallowed_on_its_way_up_still_stops_the_campaign(
    surfaces_as, tmp_path, monkeypatch
):
    """Seen in fresh-clone runs of the signal test above: the KeyboardInterrupt was caught inside
    the search and surfaced as a bare AssertionError, reported as an infrastructure error (exit
    3, slice "done"); or it was raised in Hypothesis's garbage-collector callback, where Python
    prints it ("Exception ignored ... Traceback") and goes on. Here the search catches the
    interrupt itself and raises, or returns as if it had ended, or meets it in a gc callback
    and carries on to its next example."""
    from verify.running import search
    from verify.running.engine import SearchResult

    went_on = []

    def swallowing_search(names, *, on_example, **kwargs):
        if surfaces_as == "ignored":
            _interrupt_inside_gc_callback()
            on_example(CaseSpec(), [])  # the next example: the campaign must stop here
            went_on.append(True)
            return SearchResult(property=names[0])
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the campaign's handler raises KeyboardInterrupt in here
        except KeyboardInterrupt:
            pass
        if surfaces_as == "exception":
            raise AssertionError
        return SearchResult(property=names[0])

    monkeypatch.setattr(search, "run_property", swallowing_search)
    unraisable = []  # what Python would print as "Exception ignored ... Traceback"
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    config = CampaignConfig(
        impl="lce-torch", tp_sizes=(1,), budget_s=60, out_dir=tmp_path / "out",
        properties=("differential",), max_examples=3,
    )  # fmt: skip
    result = run_campaign(config, Progress("test", 60, stream=None))
    doc = result.report
    assert result.interrupted == "SIGINT" and doc["interrupted"] == "SIGINT"
    assert doc["errors"] == [] and doc["failures"] == [] and result.artifacts == []
    assert doc["slices"][-1]["status"] == "interrupted" and doc["passed"] is False
    assert unraisable == [] and not went_on  # nothing printed for our own stop; no example more


def test_the_search_s_own_error_is_a_harness_error(tmp_path, monkeypatch):
    """An exception no case's run raised (Hypothesis's, the strategies'): the GPU nightly saved
    Hypothesis's 'FlakyStrategyDefinition: Inconsistent data generation' as a failure of lce
    (exit 1). It is the harness's: a `harness` verdict on the last drawn spec, exit 4."""
    from hypothesis.errors import FlakyStrategyDefinition

    from verify.running import search

    specs = search.campaign_specs

    def inconsistent(spec: CaseSpec) -> CaseSpec:
        if spec.tokens > 3:
            raise FlakyStrategyDefinition("Inconsistent data generation! (planted)")
        return spec

    monkeypatch.setattr(search, "campaign_specs", lambda **kw: specs(**kw).map(inconsistent))
    config = CampaignConfig(
        impl="lce-torch", tp_sizes=(1,), budget_s=60, out_dir=tmp_path / "out",
        properties=("differential",), max_examples=20,
    )  # fmt: skip
    doc = run_campaign(config, Progress("test", 60, stream=None)).report
    (failure,) = doc["failures"]
    assert failure["harness"] and "FlakyStrategyDefinition" in failure["line"], failure
    assert campaign_exit_code(doc) == EXIT_HARNESS
