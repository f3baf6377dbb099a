"""The benchmark's interleaved timing (benchmarks/rounds.py), with a made-up clock: a drift that
slows every call in turn must fall on every row alike, not on the rows timed last."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from rounds import Rounds


class DriftingClock:
    """Each call takes its base time plus ``drift`` ms per call made before it (clocks dropping
    under a sustained load); records the order of the calls."""

    def __init__(self, drift: float) -> None:
        self.drift, self.calls = drift, []

    def timer(self, call) -> float:
        self.calls.append(call)
        return call() + self.drift * (len(self.calls) - 1)


def test_equal_calls_get_equal_times_under_a_drift() -> None:
    clock = DriftingClock(drift=0.1)
    table = Rounds(clock.timer)
    calls = [lambda: 10.0, lambda: 10.0, lambda: 10.0, lambda: 10.0]
    rows = [table.add({"method": f"m{i}"}, call) for i, call in enumerate(calls)]
    table.time(rounds=4)
    assert [len(row["round_ms"]) for row in rows] == [4] * 4
    medians = [row["ms"] for row in rows]
    # Timed in blocks, the last method would take 1.2 ms more than the first (12 calls later);
    # interleaved, the medians differ by less than one round's drift (0.4 ms).
    assert max(medians) - min(medians) < 0.4
    # Each call ran at several places of its rounds: first in one round, last or later in another.
    positions = {id(c): [i % 4 for i, x in enumerate(clock.calls) if x is c] for c in calls}
    assert all(len(set(p)) >= 2 for p in positions.values())


def test_an_errored_row_is_not_timed_and_a_raising_call_leaves_the_rounds() -> None:
    table = Rounds(lambda call: call())
    table.add({"method": "broken at check", "error": "ValueError: x"}, None)
    state = {"n": 0}

    def flaky() -> float:
        state["n"] += 1
        if state["n"] == 2:
            raise RuntimeError("CUDA error: an illegal memory access")
        return 5.0

    good = table.add({"method": "good"}, lambda: 3.0)
    bad = table.add({"method": "flaky"}, flaky)
    rows = table.time(rounds=3)
    assert [r["method"] for r in rows] == ["broken at check", "good", "flaky"]
    assert good["ms"] == 3.0 and good["round_ms"] == [3.0, 3.0, 3.0]
    assert "ms" not in bad and bad["error"].startswith("RuntimeError: CUDA error")
    assert state["n"] == 2  # not called again after it raised
    assert "ms" not in rows[0] and "round_ms" not in rows[0]
