"""The campaign's progress line: slice, examples, examples/s, failures so far, time vs budget.

On a terminal one line is redrawn in place; otherwise (CI logs) a line is printed every few seconds.
"""

from __future__ import annotations

import time
from typing import TextIO


class Progress:
    """Counts examples and failures; `line` is what is shown."""

    def __init__(
        self, label: str, budget_s: float, stream: TextIO | None, interval_s: float | None = None
    ) -> None:
        self.label = label
        self.budget_s = budget_s
        self.stream = stream
        self.tty = bool(stream is not None and stream.isatty())
        self.interval_s = interval_s if interval_s is not None else (0.5 if self.tty else 10.0)
        self.began = time.monotonic()
        self.examples = 0
        self.failures = 0
        self.slice = ""
        self._shown = 0.0

    def start_slice(self, backend: str, tp: int) -> None:
        self.slice = f"{backend} TP={tp}"
        self._show(force=True)

    def example(self) -> None:
        self.examples += 1
        self._show()

    def failure(self) -> None:
        self.failures += 1
        self._show(force=True)

    def finish(self, interrupted: str | None = None) -> None:
        """The last line, ``done``; none when ``interrupted`` (the caller's summary says it)."""
        self.slice = "done"
        if not interrupted:
            self._show(force=True)
        if self.tty and self.stream is not None:
            self.stream.write("\n")

    def line(self) -> str:
        elapsed = time.monotonic() - self.began
        rate = self.examples / elapsed if elapsed > 0 else 0.0
        return (
            f"[{self.label}] {self.slice:<13} {self.examples:>6} examples {rate:6.2f}/s "
            f"failures {self.failures}  {elapsed:5.0f}/{self.budget_s:.0f} s"
        )

    def _show(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.stream is None or (not force and now - self._shown < self.interval_s):
            return
        self._shown = now
        self.stream.write(("\r" + self.line() + "\x1b[K") if self.tty else self.line() + "\n")
        self.stream.flush()
