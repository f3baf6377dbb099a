"""A benchmark's rows timed together in interleaved rounds, so a drift of the card's clocks falls
on every row alike.

Under a sustained GEMM load a GPU lowers its clocks over seconds (on an H100 one lce call took
35.8, 36.1 and 39.3 ms in succession, and a run's GEMM timing moves 2-3% from its start to its
end). Timing each method in a block of calls of its own then favours the methods timed first: in
`kernel_gpu.py` those were the peers, lce's scalar-loss rows came after them. `Rounds` times every
row in each round, the order rotated and reversed from one round to the next, and takes each
row's median over the rounds.

Under these loads an H100 runs at its power cap (NVML names the software power cap as the reason
for its clocks throughout), so a call's speed also depends on the load just before it: at
llama3-8k four GEMMs in one call took 42.7 ms queued behind a 25 ms low-power spin, 46.0 ms right
after a sync and 49.4 ms queued behind another such call. `BehindLoad` gives every row the same
start: queued behind the same block of GEMMs, as an LM head runs behind a model's last layers.
"""

from __future__ import annotations

import functools
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


class BehindLoad:
    """A `Timer`: `event_ms` of each call queued behind ``load_ms`` of bf16 GEMMs of a fixed
    shape, enqueued with the host ahead of the card, so every call starts at the same power
    state, and no call waits on its own launches. (The host time a path spends before its first
    kernel after a sync is `host_overhead.py`'s measure.)"""

    def __init__(self, load_ms: float = 20.0) -> None:
        self.load_ms = load_ms
        self._operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._gemms = 0

    def _load(self) -> None:
        if self._operands is None:  # 8192 x 16384 x 4096: 1.1 TFLOP, about 1.6 ms on an H100
            new = functools.partial(torch.randn, dtype=torch.bfloat16, device="cuda")
            self._operands = (new(8192, 4096), new(16384, 4096), new(8192, 16384))
            self._load_gemm()  # warm-up: cuBLAS picks its kernel
            self._gemms = max(1, round(self.load_ms / event_ms(self._load_gemm)))
        for _ in range(self._gemms):
            self._load_gemm()

    def _load_gemm(self) -> None:
        a, b, out = self._operands
        torch.mm(a, b.T, out=out)

    def __call__(self, call: Call) -> float:
        self._load()
        return event_ms(call)


TIMERS: dict[str, Callable[[], Timer]] = {
    "loaded": BehindLoad,  # queued behind a GEMM load, host ahead (see the module docstring)
    "synced": lambda: event_ms,  # right after the last call's sync: the host's launches exposed
}


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
