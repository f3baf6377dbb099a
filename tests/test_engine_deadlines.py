"""`run_property`'s two deadlines: searching stops at the first, shrinking at the second, and the
result keeps what the search had found (the campaign and the adapters rely on both)."""

from __future__ import annotations

import math
import time

from verify.execution.runner import Runner
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
