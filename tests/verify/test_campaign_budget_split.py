"""The campaign's budget split (`verify.running.campaign`): every slice searches for an equal
share of the time left, time a slice leaves over flows to the later ones, and its planned
examples (landmarks, covering rows) may run past its share only while every later slice keeps
`KEPT_SHARE` of the equal share it had at the start. Once the planned examples had no bound (the
torch slices' rows took all but 15 s of 300 s, leaving the interpreter's slices 1-2 examples);
then they stopped at the share (the torch TP = 4 slice reached 42% of its pairs on 2 cores)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verify.running import campaign
from verify.running.config import CampaignConfig

SLICES = tuple((backend, tp) for backend in ("torch", "triton") for tp in (1, 2, 4))


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.parametrize("early", [None, 1, "planned"])
def test_each_slice_gets_an_equal_share_of_the_time_left(monkeypatch, early) -> None:
    """Each slice searches to its share, but the one at index ``early``, which ends after 10 s;
    with ``early="planned"`` each slice's planned examples run as far as they may."""
    clock = _Clock()
    monkeypatch.setattr(campaign, "time", SimpleNamespace(monotonic=clock.monotonic))
    seen: list[tuple[str, int, float, float]] = []

    def run_slice(self, with_status: bool) -> None:
        search = self.search
        began = clock.now
        end = clock.now + 10.0 if len(seen) == early else search.deadlines[0]
        if early == "planned":  # plans longer than the budget: each runs as far as it may
            end = search.explicit_until
        clock.now = end
        seen.append((search.backend, search.tp, search.deadlines[0] - began,
                     search.explicit_until - began))  # fmt: skip
        self.tally.slices.append({"backend": search.backend, "tp": search.tp})

    monkeypatch.setattr(campaign._SliceRuns, "_run_slice", run_slice)
    monkeypatch.setattr(
        campaign._SliceRuns,
        "_slice",
        lambda self, backend, tp: SimpleNamespace(backend=backend, tp=tp),
    )
    config = SimpleNamespace(on_gpu=False)
    chosen = SimpleNamespace(slices=SLICES, adapter=SimpleNamespace(label=str))
    tally = SimpleNamespace(slices=[])
    progress = SimpleNamespace(start_slice=lambda *args: None)
    runs = campaign._SliceRuns(config, chosen, tally, progress, None, clock.now + 300.0)
    runs.run_all()
    assert [(b, t) for b, t, _, _ in seen] == list(SLICES)
    shares = [share for _, _, share, _ in seen]
    planned = [until for _, _, _, until in seen]
    kept = campaign.KEPT_SHARE * 50.0  # of the equal share at the start, 300 s / 6
    if early is None:
        assert shares == pytest.approx([50.0] * 6)
        # planned examples may run until each later slice would keep its 25 s
        assert planned == pytest.approx([175.0, 150.0, 125.0, 100.0, 75.0, 50.0])
    elif early == 1:  # the 40 s slice 1 left over flow to the four after it
        assert shares[:2] == pytest.approx([50.0, 50.0])
        assert shares[2:] == pytest.approx([60.0] * 4)
    else:  # the first plan takes what it may; every later slice still gets its floor
        assert planned[0] == pytest.approx(300.0 - 5 * kept)
        assert planned[1:] == pytest.approx([kept] * 5)


def test_a_gpu_campaign_plans_the_triton_slices(monkeypatch) -> None:
    """Which backends run is asked for the campaign's device: asked for the CPU alone, the GPU
    nightly (no TRITON_INTERPRET there) planned torch slices only and never ran the compiled
    kernel through its campaign (found on an H100, 2026-11-25)."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = CampaignConfig(impl="lce", backends=("triton", "torch"), tp_sizes=(1,), device="cuda")
    assert {b for b, _ in campaign.plan(config).slices} == {"torch", "triton"}
    assert "triton" not in campaign.available_backends("cpu")
