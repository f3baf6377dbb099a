"""The mutation self-test: the ``ci`` profile (landmark specs first, then the search) kills every
planted bug, and the killing spec passes without the bug (shrinking is left to ``verify
mutants``)."""

from __future__ import annotations

import pytest

from verify.distributed import WorkerPool
from verify.running.mutants import MUTANTS, applied
from verify.running.selftest import format_table, mutation_table

MAX_EXAMPLES = 40  # every mutant dies within this many ci examples (measured: <= 30)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(world_size=2, timeout_s=120) as workers:
        yield workers


def test_every_mutant_is_killed(pool) -> None:
    rows = mutation_table(pool=pool, max_examples=MAX_EXAMPLES, shrink=False)
    table = format_table(rows)
    assert len(rows) == len(MUTANTS) >= 12, table
    assert all(r.counts for r in rows), table


def test_unknown_mutant_is_a_clear_error() -> None:
    with (
        pytest.raises(ValueError, match="unknown mutant 'nope'; known: padded_lanes_zero"),
        applied("nope"),
    ):
        pass
