"""The mutation self-test: does the engine kill every planted bug of `verify.execution.mutants`?

`mutation_table()` searches with each mutant planted, records which property killed it after how
many examples and the shrunk spec, and re-checks that spec without the mutant (a kill only counts
when the correct implementation passes it). `format_table()` prints it for ``verify mutants``.
"""

from __future__ import annotations

import builtins
import itertools
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from hypothesis import strategies as st

from verify.cases.spec import DTYPE_PAIRS, CaseSpec
from verify.cases.strategies import case_specs, landmark_specs
from verify.execution.mutants import MUTANTS
from verify.execution.runner import Runner
from verify.properties.catalog import SELFTEST_PROPERTIES
from verify.running.engine import SearchResult, check_case, run_property
from verify.running.pairwise import plan_slice
from verify.running.reduce import reduce_failure

SELFTEST_PAIRS = DTYPE_PAIRS


def selftest_specs(
    tp_sizes: tuple[int, ...], backends: tuple[str, ...] = ("torch",)
) -> st.SearchStrategy[CaseSpec]:
    """`case_specs` at ``tp_sizes`` on ``backends`` over every dtype pair they take
    (``SELFTEST_PAIRS``)."""
    return case_specs(tp_sizes=tp_sizes, pairs=SELFTEST_PAIRS, backends=backends)


@dataclass
class KillRow:
    mutant: str
    bug: str
    killed: bool
    examples: int | None  # examples until the first failure
    property: str = ""
    output: str = ""
    measured: float = 0.0
    allowed: float = 0.0
    shrunk_spec: str = ""
    clean_passes: bool | None = None  # the shrunk spec passes without the mutant
    # killed on a planned example (a landmark or a covering row: Hypothesis does not shrink it,
    # `reduce_failure` does when shrinking)
    on_landmark: bool = False
    seconds: float = 0.0

    @builtins.property  # the field `property` shadows the builtin in this class body
    def counts(self) -> bool:
        """A real kill: a numerical or contract failure (not the mutant crashing) on a spec the
        correct implementation passes."""
        return self.killed and bool(self.clean_passes) and self.output != "status"

    def to_json(self) -> dict:
        return asdict(self) | {"counts": self.counts}


def mutation_table(
    mutants: Iterable[str] | None = None,
    *,
    pool=None,
    profile: str = "ci",
    max_examples: int | None = None,
    properties: tuple[str, ...] = SELFTEST_PROPERTIES,
    strategy: st.SearchStrategy[CaseSpec] | None = None,
    shrink: bool = True,
    landmarks: bool = True,
    backends: tuple[str, ...] = ("torch",),
) -> list[KillRow]:
    """One `KillRow` per mutant (default: all). TP mutants need ``pool`` (TP > 1 specs).

    With ``shrink``, the search runs first on its own, so its kill is shrunk to a minimal spec;
    a mutant it misses gets a second search that starts from `landmark_specs` (``landmarks``;
    a kill on a landmark itself is not shrunk, and ``on_landmark`` says so). Without ``shrink``,
    the landmarks run first: the fastest robust kill (the test suite's mode). A ``pool`` runs
    every case on its workers (without one, in this process). ``backends``: where the default
    search and the landmarks plant the bugs.
    """
    rows = []
    for name in mutants or MUTANTS:
        runner = Runner(pool, mutant=name)
        search = strategy if strategy is not None else selftest_specs(runner.tp_sizes, backends)
        marks = planned_examples(name, runner, properties, backends) if landmarks else []
        began = time.perf_counter()
        result, planned = _hunt(runner, properties, search, marks, profile, max_examples, shrink)
        rows.append(_row(name, result, Runner(pool), properties, planned))
        rows[-1].seconds = time.perf_counter() - began
    return rows


def planned_examples(
    name: str, runner: Runner, properties: tuple[str, ...], backends: tuple[str, ...]
) -> list[CaseSpec]:
    """What a campaign's slices run first, for mutant ``name``: the landmark specs, then each
    slice's pairwise covering rows (`verify.running.pairwise`) at the TP degrees where the bug
    changes anything."""
    marks = landmark_specs(runner.tp_sizes, backends)
    tps = [tp for tp in runner.tp_sizes if tp >= MUTANTS[name].min_tp]
    for backend, tp in itertools.product(backends, tps):
        at = tuple(s for s in marks if s.tp == tp and s.backend == backend)
        marks += plan_slice(runner.adapter, backend, tp, properties, at).rows
    return marks


def _hunt(
    runner: Runner,
    properties: tuple[str, ...],
    search: st.SearchStrategy[CaseSpec],
    marks: list[CaseSpec],
    profile: str,
    max_examples: int | None,
    shrink: bool,
) -> tuple[SearchResult, bool]:
    """The searches for one planted bug, in order until one kills it: with ``shrink`` the plain
    search, then one starting from the planned examples ``marks``; without, the planned
    examples' one alone. Also whether the kill was on a planned example (which Hypothesis does
    not shrink: with ``shrink``, `reduce_failure` reduces it as a campaign does)."""
    for examples in [[], marks] if shrink else [marks]:
        result = run_property(
            properties, strategy=search, profile=profile, runner=runner,
            max_examples=max_examples, shrink=shrink, examples=examples,
            first_failure_only=not shrink,
        )  # fmt: skip
        result.raise_errors()  # an exception is no kill: the mutant broke the run
        if not (result.passed and marks):  # killed, or no landmarks left to start from
            break
    planned = bool(result.failure) and result.shrunk_spec in marks
    if shrink and planned:

        def check(spec: CaseSpec) -> list:
            return check_case(spec, properties=properties, runner=runner)

        spec = result.shrunk_spec
        simplest = CaseSpec(backend=spec.backend, tp=spec.tp)
        _, result.failure = reduce_failure(spec, result.failure, check, simplest, math.inf)
    return result, planned


def _row(name: str, result, clean: Runner, properties: tuple[str, ...], planned: bool) -> KillRow:
    row = KillRow(name, MUTANTS[name].bug, not result.passed, result.first_failure_at)
    if result.failure:
        first = result.failure[0]
        row.property, row.output, row.shrunk_spec = first.property, first.output, first.spec
        row.measured, row.allowed = first.measured, first.allowed
        row.on_landmark = planned
        verdicts = check_case(result.shrunk_spec, properties=properties, runner=clean)
        row.clean_passes = not any(v.failed for v in verdicts)
    return row


def format_table(rows: list[KillRow]) -> str:
    """A plain-text table: mutant, killed, examples, property/output, measured vs allowed."""
    lines = [f"{'mutant':32} {'killed':6} {'examples':8} {'by':34} measured/allowed  seconds"]
    for r in rows:
        by = f"{r.property}:{r.output}" if r.killed else "-"
        state = "yes" if r.killed and r.clean_passes else ("NO" if not r.killed else "dirty")
        state = "crash" if r.killed and r.output == "status" else state
        ratio = f"{r.measured:.3g}/{r.allowed:.3g}" if r.killed else "-"
        count = f"{r.examples or '-'}{'*' if r.on_landmark else ''}"
        lines.append(f"{r.mutant:32} {state:6} {count:8} {by:34} {ratio:17} {r.seconds:.1f}")
    killed = sum(r.counts for r in rows)
    lines.append(
        f"killed {killed}/{len(rows)} (* = on a planned example, a landmark or a covering row:"
        " reduced field by field when shrinking, else as it was)"
    )
    return "\n".join(lines)
