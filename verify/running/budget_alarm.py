"""A search's deadline enforced between examples, where its own per-example check never runs.

Hypothesis spends stretches without calling the test: drawing inputs that a filter rejects,
hill-climbing a `target` score through cached or invalid candidates, shrinking through cached
ones. A GPU campaign's searches (examples of ~40 ms) were seen there 30 s past the budget, in
the targeted phase's optimiser, and its watchdog reported healthy searches as infrastructure
errors. `BudgetAlarm` raises `BudgetExhausted` in the main thread at the deadline when no
example is running; an example that is running ends on its own deadline check.
"""

from __future__ import annotations

import _thread
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

# The signal whose handler the alarm borrows while active. The timer thread does not send it
# (`_thread.interrupt_main` runs the main thread's Python handler at its next bytecode); a real
# SIGALRM (pytest-timeout's, a user's) still reaches the handler that was installed before.
ALARM_SIGNAL = signal.SIGALRM
# When the alarm fires during an example, or before a deadline that moved later (a failure found
# meanwhile: shrinking has its own deadline), it looks again this many seconds later at the most.
RECHECK_S = 1.0


class BudgetExhausted(BaseException):
    """Raised inside a search past its deadline to stop it; a BaseException, so Hypothesis does
    not take it for a failure of the test (and does not shrink it)."""


class BudgetAlarm:
    """While active (a `with` block on the main thread), stops the search: `BudgetExhausted` is
    raised in the main thread once ``due()`` (``time.monotonic()`` seconds, re-read each time the
    alarm looks) has passed, at least one `example()` block has run (a search that starts late
    still runs one) and none runs now. Inactive (a no-op) off the main
    thread, or when the alarm signal's handler was installed outside Python (it could not be put
    back)."""

    def __init__(self, due: Callable[[], float]) -> None:
        self._due = due
        # Reentrant: the handler runs on the main thread, possibly inside its own `with` below.
        self._lock = threading.RLock()
        self._active = False
        self._fired = threading.Event()  # set by the timer: the next handler call is ours
        self._timer: threading.Timer | None = None
        self._in_example = False
        self._examples = 0
        self._previous: Any = None

    def __enter__(self) -> BudgetAlarm:
        previous = signal.getsignal(ALARM_SIGNAL)
        if threading.current_thread() is not threading.main_thread() or previous is None:
            return self
        self._previous = signal.signal(ALARM_SIGNAL, self._on_signal)
        with self._lock:
            self._active = True
            self._arm(self._due() - time.monotonic())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is None:
            return
        with self._lock:
            self._active = False
            if self._timer is not None:
                self._timer.cancel()
        # signal.signal runs a pending call first, with this handler: inactive, it does nothing.
        signal.signal(ALARM_SIGNAL, self._previous)
        self._previous = None

    @contextmanager
    def example(self) -> Iterator[None]:
        """Mark one example running: the alarm leaves it to its own deadline check."""
        self._in_example = True
        try:
            yield
        finally:
            self._in_example = False
            self._examples += 1

    def _arm(self, seconds: float) -> None:
        """Fire in ``seconds`` (never, if infinite); the caller holds the lock."""
        if not math.isfinite(seconds):
            return
        self._timer = threading.Timer(max(0.0, seconds), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._active:
                self._fired.set()
                _thread.interrupt_main(ALARM_SIGNAL)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._fired.is_set():  # a real SIGALRM: whoever installed a handler before us
            self._chain(signum, frame)
            return
        self._fired.clear()
        with self._lock:
            if not self._active:
                return  # the search has ended
            left = self._due() - time.monotonic()
            between_examples = self._examples > 0 and not self._in_example
            if left <= 0 and between_examples:
                self._active = False
                raise BudgetExhausted
            self._arm(left if between_examples else min(max(left, 0.0), RECHECK_S))

    def _chain(self, signum: int, frame: FrameType | None) -> None:
        if callable(self._previous):
            self._previous(signum, frame)
        elif self._previous == signal.SIG_DFL:  # the default action (terminate), as it would be
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
