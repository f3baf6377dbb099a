"""`run_property`'s two deadlines: searching stops at the first, shrinking at the second, and the
result keeps what the search had found (the campaign and the adapters rely on both)."""

from __future__ import annotations

import math
import signal
import time

import pytest

from verify.cases.spec import CaseSpec
from verify.execution.runner import Runner
from verify.running.budget_alarm import RECHECK_S, BudgetAlarm, BudgetExhausted
from verify.running.engine import run_property
from verify.running.mutants import applied
from verify.running.selftest import SELFTEST_PROPERTIES, selftest_specs

SPECS = selftest_specs((1,))


def test_search_stops_after_the_example_that_passes_its_deadline() -> None:
    result = run_property(
        "differential", strategy=SPECS, max_examples=50, deadlines=(time.monotonic(), math.inf)
    )
    assert result.stopped and result.passed and result.examples == 1


def test_shrinking_stopped_keeps_the_failure_unshrunk() -> None:
    """A planted bug: with no time to shrink, the first failing example is the result; with
    time, the shrunk one, and in both the examples counted end at the first failure."""
    with applied("grad_output_row0"):
        options = {"strategy": SPECS, "runner": Runner(), "max_examples": 40}
        cut = run_property(SELFTEST_PROPERTIES, deadlines=(math.inf, time.monotonic()), **options)
        full = run_property(SELFTEST_PROPERTIES, **options)
    assert cut.stopped and not cut.passed and cut.shrunk_spec is not None
    assert not full.stopped and not full.passed
    for result in (cut, full):
        assert result.examples == result.first_failure_at >= 1
    # The same seedless ci profile draws the same examples: the stop came at the first failure.
    assert cut.first_failure_at == full.first_failure_at


def test_search_stops_at_its_deadline_between_examples() -> None:
    """Hypothesis can go on without calling the test: here drawing the second example spins
    past the deadline (a GPU campaign's targeted phase spent 30 s on overrunning candidates,
    never calling the test). The alarm stops the search at the deadline; the per-example check
    alone waited for the example's end, `SPIN_S` later."""
    drawn: list[float] = []

    def spin_on_the_second(spec: CaseSpec) -> CaseSpec:
        drawn.append(time.monotonic())
        while len(drawn) == 2 and time.monotonic() < deadline + SPIN_S:
            time.sleep(0.01)
        return spec

    deadline = time.monotonic() + 3.0
    result = run_property(
        "differential",
        strategy=SPECS.map(spin_on_the_second),
        max_examples=100,
        deadlines=(deadline, deadline),
    )
    ended = time.monotonic()
    assert len(drawn) == 2 and drawn[1] < deadline, "the first example ran past the deadline"
    assert result.stopped and result.passed and result.examples == 1
    assert ended - deadline < 1.0, f"stopped {ended - deadline:.1f} s past the deadline"


SPIN_S = 5.0


def test_the_alarm_waits_for_a_running_example_and_then_stops() -> None:
    began = time.monotonic()
    with pytest.raises(BudgetExhausted), BudgetAlarm(lambda: began + 0.1) as alarm:
        with alarm.example():
            time.sleep(0.3)  # past the deadline, inside an example: not interrupted
        example_ended = time.monotonic()
        while time.monotonic() < example_ended + RECHECK_S + 5:
            time.sleep(0.01)  # Hypothesis between examples
    assert time.monotonic() - example_ended <= RECHECK_S + 1.0


def test_a_real_alarm_signal_reaches_the_handler_installed_before() -> None:
    """pytest-timeout (the suite's) and users' code time out with SIGALRM: the alarm borrows
    its handler only for the search and passes real signals on."""
    received: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: received.append(signum))
    try:
        with BudgetAlarm(lambda: math.inf):
            signal.raise_signal(signal.SIGALRM)
        assert received == [signal.SIGALRM]
        assert signal.getsignal(signal.SIGALRM) is not None
        signal.raise_signal(signal.SIGALRM)
        assert received == [signal.SIGALRM] * 2
    finally:
        signal.signal(signal.SIGALRM, previous)
