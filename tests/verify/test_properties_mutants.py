"""The mutation self-test: the ``ci`` profile (landmark specs first, then the search) kills every
planted bug, and the killing spec passes without the bug (shrinking is left to ``verify
mutants``)."""

from __future__ import annotations

import pytest

from verify.distributed import WorkerPool
from verify.execution.mutants import MUTANTS, applied
from verify.running.selftest import format_table, mutation_table

MAX_EXAMPLES = 40  # every mutant dies within this many ci examples (measured: <= 30)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(world_size=2, timeout_s=120) as workers:
        yield workers


@pytest.mark.slow
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


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_a_planted_mutant_leaves_the_3_gemm_loss_path_runnable(name: str) -> None:
    # Found by a campaign with --mutant on the nightly profile: the bent stages hid the 3-GEMM
    # loss pass's chunk sizing (`loss_chunk_rows`), so every main_grad example raised
    # AttributeError inside the wrapper and the search saved "ExceptionGroup: Hypothesis found 2
    # distinct failures" instead of the planted bug's verdicts.
    from verify.cases.spec import CaseSpec
    from verify.running.engine import check_case

    spec = CaseSpec(tokens=3, vocab=5, reduction="mean", loss_path="main_grad")
    if not MUTANTS[name].applies_to(spec.backend) or MUTANTS[name].min_tp > 1:
        pytest.skip(f"{name} is not planted on {spec.backend} at TP=1")
    with applied(name):
        verdicts = check_case(spec, properties=["main_grad"])
    assert verdicts and not [v for v in verdicts if v.tier == "harness"], verdicts
