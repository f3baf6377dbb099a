"""A benchmark's rows timed together in interleaved rounds, so a drift of the card's clocks falls
on every row alike.

Under a sustained GEMM load a GPU lowers its clocks over seconds (on an H100 one lce call took
35.8, 36.1 and 39.3 ms in succession, and a run's GEMM timing moves 2-3% from its start to its
end). Timing each method in a block of calls of its own then favours the methods timed first: in
`kernel_gpu.py` those were the peers, lce's scalar-loss rows came after them. `Rounds` times every
row in each round, the order rotated and reversed from one round to the next, and takes each
row's median over the rounds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

Call = Callable[[], object]
Timer = Callable[[Call], float]


def event_ms(call: Call) -> float:
    """One call timed by CUDA events, in ms (the device's time from its first launch to the end of
    its last kernel, host gaps between them included)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


class Rounds:
    """The rows of one table and the calls they time; ``timer`` times one call in ms."""

    def __init__(self, timer: Timer) -> None:
        self.rows: list[dict] = []
        self._calls: list[tuple[dict, Call]] = []
        self._timer = timer

    def add(self, row: dict, call: Call | None) -> dict:
        """Add ``row``; `time` times ``call`` into it unless it already records an ``error``
        (then ``call`` may be None)."""
        self.rows.append(row)
        if "error" not in row and call is not None:
            self._calls.append((row, call))
        return row

    def order(self, round_index: int, rounds: int) -> list[tuple[dict, Call]]:
        """Round ``round_index``'s calls: rotated by its share of the rounds, every other round
        reversed, so each call runs at several places in a round."""
        shift = round_index * len(self._calls) // max(rounds, 1)
        calls = self._calls[shift:] + self._calls[:shift]
        return calls[::-1] if round_index % 2 else calls

    def time(self, rounds: int) -> list[dict]:
        """Run ``rounds`` rounds; each timed row gets ``round_ms`` (in round order) and ``ms``
        (their median). A call that raises in a round gets the ``error`` and leaves the rounds."""
        for index in range(rounds):
            for row, call in self.order(index, rounds):
                try:
                    row.setdefault("round_ms", []).append(self._timer(call))
                except Exception as exc:  # recorded on its row; the other rows go on
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    self._calls = [entry for entry in self._calls if entry[0] is not row]
        for row, _ in self._calls:
            row["ms"] = statistics.median(row["round_ms"])
        return self.rows
