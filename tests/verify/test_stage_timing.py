"""Where an example's time goes (issue 23): the stage clock, the job's split, the report's table,
and the build cache that the split showed was worth having."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verify.cases.build import build
from verify.cases.spec import CaseSpec
from verify.execution import stage_timing
from verify.execution.runner import Runner
from verify.execution.stage_timing import STAGES, StageClock
from verify.properties import oracle as oracle_module
from verify.results import report

ROOT = Path(__file__).resolve().parents[2]


def test_nested_stages_are_exclusive_and_add_up_to_the_wall_time():
    now = [0.0]
    clock = StageClock(timer=lambda: now[0])
    with clock.stage("compare"):
        now[0] += 2.0
        with clock.stage("dispatch"):
            now[0] += 3.0
            clock.add({"kernel": 1.0}, compiles=2)  # measured by a worker inside the dispatch
        now[0] += 1.0
    taken = clock.take()
    seconds = taken["seconds"]
    assert seconds == {"compare": 3.0, "dispatch": 2.0, "kernel": 1.0}  # 3 s less the worker's
    assert sum(seconds.values()) == now[0]  # no stage counted twice
    assert taken["compiles"] == 2
    assert clock.take() == {"seconds": {}, "compiles": 0}


def test_a_runs_stages_reach_the_driver_clock_through_the_runner():
    spec = CaseSpec(tokens=4, hidden_size=8, vocab=5, upstream="random")
    with stage_timing.recording() as clock:
        run = Runner().run(spec)
    assert run.status == "ok"
    seconds = clock.take()["seconds"]
    assert {"build", "kernel", "transfer", "dispatch"} <= set(seconds)
    assert seconds["kernel"] > 0 and seconds["build"] > 0


def test_report_splits_each_backends_wall_time_into_stages():
    tally = report.Tally()
    taken = {"seconds": {"kernel": 0.5, "reference": 0.25}, "compiles": 3}
    tally.add_timing("triton", "numerical", taken, wall_s=1.0, ended=11.0)
    tally.add_timing(
        "triton", "numerical", {"seconds": {"kernel": 0.5}, "compiles": 0}, 1.0, ended=12.0
    )
    doc = report.to_json(tally, {"wall_s": 2.0})
    (row,) = doc["timing"]
    assert (row["backend"], row["kind"], row["examples"], row["compiles"]) == (
        "triton", "numerical", 2, 3,
    )  # fmt: skip
    assert row["examples_per_s"] == 1.0 and row["clock_s"] == 2.0  # back to back: 2 s
    assert row["seconds"]["kernel"] == 1.0
    assert row["seconds"]["other"] == 0.75  # the wall time no stage claimed
    assert list(row["seconds"]) == list(STAGES)
    table = "\n".join(report._timing_table(doc["timing"]))
    assert "triton numerical (2)" in table and "1.0 (500)" in table  # kernel: 1 s, 500 ms each


def test_concurrent_examples_count_once_on_the_clock():
    # Two searches' examples overlapping in [10, 12] and one alone in [14, 15]: 3 s of clock.
    assert report.covered_seconds([(10.0, 11.5), (14.0, 15.0), (10.5, 12.0)]) == 3.0
    tally = report.Tally()
    for ended in (11.5, 12.0, 15.0):
        tally.add_timing("triton", "numerical", {"seconds": {}, "compiles": 0}, 1.0, ended=ended)
    (row,) = report.to_json(tally, {"wall_s": 5.0})["timing"]
    assert (row["wall_s"], row["clock_s"], row["examples_per_s"]) == (3.0, 2.5, 1.2)


def test_build_is_cached_but_every_call_gets_its_own_tensors():
    spec = CaseSpec(tokens=6, hidden_size=8, vocab=7, regime="peaked", upstream="random")
    first = build(spec)
    expected_hidden = first.hidden.clone()
    first.hidden.zero_()  # a caller may modify what it got
    first.grad_logprob.fill_(7.0)
    second = build(spec)
    assert torch.equal(second.hidden, expected_hidden)
    assert not torch.equal(second.grad_logprob, first.grad_logprob)
    # A transform shares the untransformed draws and regime but not the result.
    permuted = build(spec.with_(transform="vocab_permute"))
    assert permuted.weight.shape == second.weight.shape
    assert not torch.equal(permuted.weight, second.weight)


def test_r_and_b_computed_ahead_in_a_thread_are_the_ones_computed_inline():
    spec = CaseSpec(tokens=5, hidden_size=8, vocab=9, regime="peaked", upstream="random", seed=11)
    oracle_module._oracle.cache_clear()
    oracle_module.compute_ahead(spec)
    ahead = oracle_module.oracle(spec)
    assert not oracle_module._ahead  # read once, then the cache serves it
    oracle_module._oracle.cache_clear()
    inline = oracle_module.oracle(spec)
    assert ahead is not inline
    for name in inline.ref:
        assert torch.equal(ahead.ref[name], inline.ref[name]), name
        assert torch.equal(ahead.base[name], inline.base[name]), name
    assert not Runner().offloads  # in this process: nothing to overlap with


# A kernel compiled for sm_90 (no GPU needed), then its first-launch set-up called as a launch
# would: without a GPU the set-up raises, and its time must still land in ``load``; a second
# call on a kernel already set up (module present) is not a load.
_FIRST_LAUNCH = """
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from verify.execution import stage_timing

@triton.jit
def _copy(src, dst):
    tl.store(dst, tl.load(src))

stage_timing.watch_triton_compiles()
source = ASTSource(_copy, {"src": "*fp32", "dst": "*fp32"}, {})
kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
with stage_timing.recording() as clock:
    with stage_timing.stage("kernel"):
        try:
            kernel._init_handles()
        except Exception:  # no GPU here: the set-up's time is what this checks
            pass
    first = clock.take()["seconds"]
    kernel.module = object()  # as after a set-up
    with stage_timing.stage("kernel"):
        kernel._init_handles()
    second = clock.take()["seconds"]
print(json.dumps([first, second]))
"""


def test_a_kernels_first_launch_set_up_is_timed_as_load(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    script = tmp_path / "first_launch.py"  # Triton reads a kernel's source from its file
    script.write_text(_FIRST_LAUNCH)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0 and "ptxas" in done.stderr:
        pytest.skip(f"triton cannot compile for sm_90 here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    assert first["load"] > 0 and set(first) == {"kernel", "load"}
    assert "load" not in second
