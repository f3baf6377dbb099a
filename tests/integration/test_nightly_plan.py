"""The GPU nightly's plan, checked on the CPU: every step the nightly promises, limits that add up
to the budget and pass a fast step's unused time on, and limits handed to self-timed steps."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("nightly_gpu", ROOT / "ci" / "nightly_gpu.py")
nightly = importlib.util.module_from_spec(_spec)
sys.modules["nightly_gpu"] = nightly  # dataclasses look their module up there
_spec.loader.exec_module(nightly)

PROMISED = {"environment", "kernel_tests", "kernel_benchmark", "megatron", "corpus", "mutants",
            "campaign", "adapters"}  # fmt: skip


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_plan_has_every_step_and_every_tp_degree_the_gpus_allow(tmp_path, gpus):
    steps = nightly.plan(tmp_path, gpus)
    assert {s.name for s in steps} == PROMISED
    campaign = next(s for s in steps if s.name == "campaign").command(200.0)
    assert campaign[campaign.index("--tp") + 1] == ",".join(str(t) for t in (1, 2, 4)[:gpus])
    # 90% of its limit less 45 s (start, examples in flight, report); at least half the limit
    assert campaign[campaign.index("--budget-s") + 1] == "135"
    adapters = next(s for s in steps if s.name == "adapters").command(60.0)
    assert adapters[adapters.index("--total-minutes") + 1] == "0.50"
    for step in steps:  # every command survives the substitution (the env probe has braces)
        assert step.command(100.0)


def test_limits_split_the_budget_and_roll_unused_time_forward(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(nightly.time, "monotonic", lambda: clock[0])
    steps = [
        nightly.Step(n, share, ["true"], elastic=True)
        for n, share in (("a", 1.0), ("b", 1.0), ("c", 2.0))
    ]
    limits = []
    for step, limit in nightly.limits_as_we_go(steps, budget_s=400.0):
        limits.append(limit)
        clock[0] += 20.0 if step.name == "a" else limit  # a is fast, the others use all they get
    assert limits[0] == pytest.approx(100.0)
    assert limits[1] == pytest.approx(380.0 / 3)  # a's unused 80 s shared by b and c
    assert sum([20.0, *limits[1:]]) == pytest.approx(400.0)


def test_fixed_work_may_overrun_its_share_and_the_elastic_steps_absorb_it(tmp_path, monkeypatch):
    """A fixed-work step (tests, benchmark) gets twice its share, but never the time the later
    steps need for their minimum; the elastic step after it gets what is left."""
    clock = [0.0]
    monkeypatch.setattr(nightly.time, "monotonic", lambda: clock[0])
    steps = [
        nightly.Step("tests", 1.0, ["true"]),
        nightly.Step("corpus", 3.0, ["true"]),
        nightly.Step("campaign", 1.0, ["true"], elastic=True),
    ]
    limits = []
    for step, limit in nightly.limits_as_we_go(steps, budget_s=300.0):
        limits.append(limit)
        clock[0] += 1.5 * limit / nightly.FIXED_SLACK if step.name == "tests" else limit
    assert limits[0] == pytest.approx(nightly.FIXED_SLACK * 300.0 / 5)  # 120 s, share 60 s
    # 210 s left after tests' 90 s: corpus's doubled share (252 s) is capped so that the
    # campaign keeps its minimum.
    assert limits[1] == pytest.approx(210.0 - nightly.MIN_STEP_S)
    assert limits[2] == pytest.approx(nightly.MIN_STEP_S)


def test_a_step_always_gets_the_minimum(tmp_path, monkeypatch):
    monkeypatch.setattr(nightly.time, "monotonic", lambda: 0.0)
    steps = nightly.plan(tmp_path, 1)
    assert all(limit >= nightly.MIN_STEP_S for _, limit in nightly.limits_as_we_go(steps, 1.0))


def test_adapters_left_without_time_are_reported_not_run(tmp_path):
    """gpu_adapters under --total-minutes: an implementation that would start with less than its
    JIT start-up cost plus a minimal search left is skipped and reported, and the run exits 0."""
    import json

    spec = importlib.util.spec_from_file_location("gpu_adapters", ROOT / "ci" / "gpu_adapters.py")
    adapters = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(adapters)
    assert adapters.main(["--out", str(tmp_path), "--impl", "torch", "--total-minutes", "0.5"]) == 0
    (record,) = json.loads((tmp_path / "adapters.json").read_text())["implementations"]
    assert record["impl"] == "torch" and record["skipped"].startswith("not run: 30 s")
