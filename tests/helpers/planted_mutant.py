"""A planted bug for the search-group tests: raises on an odd row count, and doubles every row's
softmax sum on an even one (log-probs off by log 2). `register` plants it in `MUTANTS` (a test
does so with monkeypatch; a worker by preloading `tests.helpers.planted_mutant_worker`)."""

from __future__ import annotations

from dataclasses import replace

from verify.execution import mutants

MUTANT = "odd_rows_raise"
BUG = "raises on odd row counts, log-probs off by log 2 on even ones"


class OddRowsRaise(mutants.MutantStages):
    """Raises AttributeError on an odd row count (as 1501560's mutants did where their wrapper hid
    a stage attribute), and doubles every row's softmax sum on an even one."""

    def forward_stats(self, hidden, weight, *args):
        if hidden.shape[0] % 2:
            raise AttributeError("planted: odd row counts reach a hidden stage attribute")
        stats = self.inner.forward_stats(hidden, weight, *args)
        return replace(stats, sumexp_nonmax=2.0 * stats.sumexp_nonmax + 1.0)


def mutant() -> mutants.Mutant:
    return mutants.Mutant(MUTANT, BUG, mutants._wrap_stages(OddRowsRaise), backends=("torch",))


def register() -> None:
    """Plant `MUTANT` in this process's `mutants.MUTANTS`."""
    mutants.MUTANTS[MUTANT] = mutant()
