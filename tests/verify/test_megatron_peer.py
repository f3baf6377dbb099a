"""The megatron_peer property never blames lce for megatron-core: where it is not installed the
property does not apply, and its job raising is a harness verdict (found by a GPU campaign run
without megatron-core: every case was saved as an lce failure, "WorkerError: rank 0 raised while
running verify.properties.peers:megatron_job", exit 1)."""

from __future__ import annotations

import pytest

from verify.cases.spec import CaseSpec
from verify.distributed import WorkerPool
from verify.execution.runner import Runner
from verify.properties import peers
from verify.properties.verdict import HARNESS
from verify.running.engine import check_case

SPEC = CaseSpec(tokens=4, vocab=8, tp=1)


@pytest.fixture(scope="module")
def runner():
    with WorkerPool(world_size=1, timeout_s=120) as pool:
        yield Runner(pool)


def test_a_raising_peer_job_is_a_harness_verdict_not_a_failure_of_lce(runner, monkeypatch):
    monkeypatch.setattr(peers, "MEGATRON_JOB", "tests.helpers.campaign_jobs:peer_raises")
    verdicts = check_case(SPEC, properties=["megatron_peer", "differential"], runner=runner)
    (peer,) = [v for v in verdicts if v.property == "megatron_peer"]
    assert peer.tier == HARNESS and "megatron-core's job raised" in peer.detail
    assert "No module named 'megatron'" in peer.detail
    lce = [v for v in verdicts if v.property == "differential"]
    assert lce and all(v.passed for v in lce)  # the other properties still judged lce


def test_megatron_peer_does_not_apply_without_megatron_core(runner, monkeypatch):
    monkeypatch.setattr(peers, "megatron_installed", lambda: False)
    assert check_case(SPEC, properties=["megatron_peer"], runner=runner) == []
    monkeypatch.undo()
    verdicts = check_case(SPEC, properties=["megatron_peer"], runner=runner)
    assert verdicts and all(v.passed for v in verdicts)  # installed here: it judges lce
