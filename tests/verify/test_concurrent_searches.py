"""Concurrent searches of one slice (`verify.running.concurrent_searches`): each runs in its own
process from its own seed, and the campaign reports them as one slice."""

from __future__ import annotations

from verify.adapters import resolve
from verify.cases.strategies import landmarks_at
from verify.results import report
from verify.running import concurrent_searches
from verify.running.campaign import run_campaign
from verify.running.config import CampaignConfig, default_count
from verify.running.progress import Progress
from verify.running.search import RESTARTS


def test_two_searches_report_as_one_slice(tmp_path):
    config = CampaignConfig(
        impl="lce-torch",
        tp_sizes=(1,),
        budget_s=240,
        out_dir=tmp_path / "out",
        properties=("status", "differential"),
        max_examples=3,
        seed=7,
        searches=2,
    )
    result = run_campaign(config, Progress("test", 240, stream=None))
    doc = result.report
    assert doc["errors"] == [] and doc["failures"] == []
    (row,) = doc["slices"]
    assert (row["backend"], row["tp"], row["status"]) == ("lce-torch", 1, "done")
    # Search 0 ran the status examples, every other planned example (landmarks, then covering
    # rows) from the first and 3 valid ones; search 1 the planned examples between and its own
    # 3 valid ones: the plan once, not once a search.
    counts = {c["property"]: 0 for c in doc["counts"]}
    for c in doc["counts"]:
        counts[c["property"]] += c["examples"]
    (coverage,) = doc["coverage"]
    valid = len(landmarks_at(1, "torch")) + coverage["rows"] + 2 * 3
    assert counts == {"status": 3, "differential": valid}
    assert row["examples"] == doc["examples"] == valid + 3
    timing = {r["kind"]: r for r in doc["timing"]}
    assert timing["numerical"]["examples"] == valid and timing["status"]["examples"] == 3
    assert 0 < timing["numerical"]["clock_s"] <= timing["numerical"]["wall_s"] + 1e-6


def test_each_search_draws_from_its_own_seeds():
    stride = 1 + RESTARTS
    firsts = [concurrent_searches.seed_of(41, k, stride) for k in range(3)]
    assert firsts == [41, 44, 47]  # search 0 keeps the campaign's; restarts use 42, 43, ...
    assert concurrent_searches.seed_of(None, 0, stride) is None  # the profile's own, as alone
    assert concurrent_searches.seed_of(None, 2, stride) == 6


def test_several_searches_only_on_cuda_at_tp_1():
    assert default_count("cuda", 1, cores=16) == 12
    assert default_count("cuda", 1, cores=2) == 1
    assert default_count("cuda", 2, cores=16) == 1
    assert default_count("cpu", 1, cores=16) == 1
    assert CampaignConfig(searches=3).searches_at(1) == 3
    assert CampaignConfig(searches=3).searches_at(2) == 1


def test_a_search_that_cannot_start_is_an_infrastructure_error(tmp_path):
    # device="cuda" without a GPU: each search's own pool refuses to start (validate() is what
    # stops this at the command line; here it reaches the search processes on purpose).
    tally = report.Tally()
    config = CampaignConfig(impl="lce-torch", tp_sizes=(1,), out_dir=tmp_path, device="cuda")
    names = ("status", "differential")
    search = concurrent_searches.ConcurrentSlice(
        config, resolve("lce-torch"), "torch", 1, names, tally, Progress("test", 60, stream=None),
        count=2, seed_stride=3,
    )  # fmt: skip
    search.run(None, with_status=True)
    assert search.status == "infrastructure error" and search.examples == 0
    messages = sorted(e["message"] for e in tally.errors)
    assert [m.split(":")[0] for m in messages] == ["search 0", "search 1"]
    assert "no GPU is visible" in messages[0]
    assert search.row()["status"] == "infrastructure error"


def test_a_failure_saved_by_two_searches_is_one_row():
    """Two searches that save the same case write one artifact file: the report lists it once
    (a GPU nightly listed one verl finding 12 times, once per search); another file is a row."""
    tally = report.Tally()
    failure = {"property": "differential", "artifact": "failures/differential-a.json"}
    tally.add_failure(dict(failure))
    tally.add_failure(dict(failure))
    tally.add_failure({**failure, "artifact": "failures/differential-b.json"})
    assert [f["artifact"] for f in tally.failures] == [
        "failures/differential-a.json",
        "failures/differential-b.json",
    ]
