"""Stopping a campaign: SIGINT/SIGTERM end it with its report so far, and a watchdog stops a search
that runs on past the budget.

`stop_signals` turns the signals into ``KeyboardInterrupt`` (and remembers that one arrived, for
when that exception is swallowed on its way up); `overrun_watch` signals the search's own process
when it overran, writing its stacks to a file first.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# How long past the campaign's deadline plus one example's deadline a search may still run
# before its watchdog stops it like SIGTERM would: its unsaved failure saved unshrunk, the slice's
# status "overrun", an infrastructure error. An example in flight ends within its own deadline
# (the pool's timeout), so only a driver stuck outside any example gets here.
OVERRUN_GRACE_S = 30.0


class _Received:
    """Which stop signal arrived (``SIGINT`` unless `stop_signals` saw another)."""

    name = "SIGINT"


# Set by a stop signal inside `stop_signals`: the KeyboardInterrupt it raises may be caught on its
# way up and surface as another exception (a bare AssertionError: exit 3, "infrastructure error",
# seen in a fresh-clone test run), or vanish where Python ignores exceptions (a garbage-collector
# callback of Hypothesis: "Exception ignored in ... gc_callback" and the campaign ran on, seen in
# the next). Searches check it between examples and after they end.
_stop_arrived = threading.Event()
# Set by `overrun_watch` when it stops the search: that stop is the budget's, not an operator's.
_overran = threading.Event()
# Whether `stop_signals` handlers are installed now (a watchdog only signals through them).
_handlers_installed = threading.Event()


def stop_requested() -> bool:
    """A stop signal arrived in the `stop_signals` block now running."""
    return _stop_arrived.is_set()


def overrun_error(stacks: Path | None = None) -> str:
    """The infrastructure error of a slice whose search overran the budget."""
    where = f"; its stacks: {stacks}" if stacks is not None else ""
    return (
        f"a search still ran {OVERRUN_GRACE_S:g} s past the budget and its examples' deadline and "
        f"was stopped (a failure it had found is saved, unshrunk){where}"
    )


def overrun_stopped() -> bool:
    """The stop now in progress is `overrun_watch`'s (the search overran the budget), and it is
    taken: stop signals work again, for the next one."""
    if not _overran.is_set():
        return False
    _overran.clear()
    _stop_arrived.clear()
    return True


def stacks_file(out_dir: Path) -> Path:
    """Where this process's watchdog writes its stacks (in the report's directory)."""
    return Path(out_dir) / f"stacks-{os.getpid()}.txt"


@contextlib.contextmanager
def overrun_watch(limit: Callable[[], float], stacks: Path) -> Iterator[None]:
    """Stop the block (KeyboardInterrupt, through `stop_signals`' handler) if it still runs
    `OVERRUN_GRACE_S` past ``limit()`` (``time.monotonic()``, read again as it moves: the budget
    plus the examples' deadline, which grows with them): wherever it is, anywhere
    `run_property`'s checks (at each example's end and each candidate of Hypothesis's engine) do
    not reach. A real signal, so a blocking call is woken too; the process's stacks go to the
    file ``stacks`` first (the next fix's evidence; the terminal stays readable). Nothing happens
    outside a `stop_signals` block of the main thread, or when ``limit()`` is infinite."""
    if not math.isfinite(limit()) or threading.current_thread() is not threading.main_thread():
        yield
        return
    main = threading.main_thread().ident
    done = threading.Event()

    def watch() -> None:
        while not done.wait(WATCH_PERIOD_S):
            if time.monotonic() < limit() + OVERRUN_GRACE_S:
                continue
            if _handlers_installed.is_set() and not _stop_arrived.is_set():
                stacks.parent.mkdir(parents=True, exist_ok=True)
                with stacks.open("w") as handle:
                    print(f"search process {os.getpid()} overran the budget:", file=handle)
                    faulthandler.dump_traceback(handle)
                _overran.set()
                signal.pthread_kill(main, signal.SIGTERM)
            return

    watcher = threading.Thread(target=watch, name="lce-overrun-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


# How often the watchdog compares the clock with its limit.
WATCH_PERIOD_S = 0.25


@contextlib.contextmanager
def stop_signals() -> Iterator[_Received]:
    """SIGINT and SIGTERM stop the block with ``KeyboardInterrupt`` (the yielded object names
    the signal); after the first, both are ignored until the block ends, so stopping the pool
    and writing the report finish. Previous handlers come back afterwards. Outside the main
    thread (no signal handlers there) nothing changes."""
    received = _Received()
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def stop(signum: int, frame: Any) -> None:
        _stop_arrived.set()
        if _overran.is_set():  # the budget's watchdog: operators' signals still stop the run
            raise KeyboardInterrupt("overrun")
        received.name = signal.Signals(signum).name
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(received.name)

    unraisable_hook = sys.unraisablehook

    def quiet_stop(unraisable: Any) -> None:
        """Our stop, raised where it cannot propagate: `stop_requested` carries it on."""
        if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and stop_requested()):
            unraisable_hook(unraisable)

    _stop_arrived.clear()
    _overran.clear()
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    sys.unraisablehook = quiet_stop
    _handlers_installed.set()
    try:
        yield received
    finally:
        _handlers_installed.clear()
        sys.unraisablehook = unraisable_hook
        _stop_arrived.clear()
        _overran.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
