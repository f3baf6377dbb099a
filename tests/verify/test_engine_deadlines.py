"""`run_property`'s two deadlines: searching stops at the first, shrinking at the second, and the
result keeps what the search had found (the campaign and the adapters rely on both)."""

from __future__ import annotations

import math
import time

from hypothesis.internal.conjecture.engine import ConjectureRunner

from verify.cases.spec import CaseSpec
from verify.execution.mutants import applied
from verify.execution.runner import Runner
from verify.running.engine import run_property
from verify.running.engine_deadline import ENGINE_ENTRIES
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
    """Hypothesis can go on without calling the test: here a filter rejects every draw after
    the first example (a GPU campaign's targeted phase spent 30 s on overrunning candidates so).
    The search stops at the engine's first candidate past the deadline; the per-example check
    alone waited for the next example, which the filter lets through `SPIN_S` past it."""
    drawn: list[float] = []

    def first_then_none(spec: CaseSpec) -> bool:
        drawn.append(time.monotonic())
        if len(drawn) > 1 and drawn[-1] < deadline + SPIN_S:
            time.sleep(0.01)
            return False
        return True

    deadline = time.monotonic() + 3.0
    result = run_property(
        "differential",
        strategy=SPECS.filter(first_then_none),
        max_examples=100,
        deadlines=(deadline, deadline),
    )
    ended = time.monotonic()
    assert len(drawn) > 1 and drawn[1] < deadline, "the first example ended past the deadline"
    assert result.stopped and result.passed and result.examples == 1
    assert ended - deadline < 1.0, f"stopped {ended - deadline:.1f} s past the deadline"
    assert all(getattr(ConjectureRunner, name) is entry for name, entry in ENTRIES.items())


SPIN_S = 5.0
ENTRIES = {name: getattr(ConjectureRunner, name) for name in ENGINE_ENTRIES}
