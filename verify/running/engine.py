"""The function API of the property engine, shared by pytest, the CLI and the pool driver.

`check_case(spec)` runs properties on one spec and returns their verdicts; `run_property(name)`
lets Hypothesis search specs for one property (shrinking a failure to its minimal spec).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from hypothesis import Phase, example, given, settings, target
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure

from verify.cases.spec import CaseSpec
from verify.cases.strategies import case_specs
from verify.distributed.errors import PoolError
from verify.execution import stage_timing
from verify.execution.deadline import BudgetExhausted
from verify.execution.runner import ImplementationFault, Runner, case_of
from verify.properties.catalog import PROPERTIES, get
from verify.properties.oracle import compute_ahead
from verify.properties.verdict import PropertyVerdict, fault_verdict, harness_error
from verify.running.engine_deadline import deadline_in_engine
from verify.running.profiles import profile_settings


class PropertyFailure(AssertionError):
    """A case failed; the message is one line per failing verdict (property, output, tier,
    measured vs allowed, spec JSON)."""

    def __init__(self, verdicts: list[PropertyVerdict]) -> None:
        self.verdicts = verdicts
        super().__init__("\n".join(v.line() for v in verdicts))


def check_case(
    spec: CaseSpec,
    *,
    properties: Iterable[str] | None = None,
    runner: Runner | None = None,
    backend: str | None = None,
) -> list[PropertyVerdict]:
    """Verdicts of ``properties`` (default: all) on ``spec``; ``backend`` overrides the spec's.

    A property that does not cover the spec (`Property.covers`) adds no verdict. TP > 1 specs
    need a runner with a pool. An exception of a property's own code becomes its failing
    `harness_error` verdict (the other properties still run); one raised while running the case
    propagates. The implementation crashing or hanging (`ImplementationFault`) is a failing
    verdict of that kind, and ends the example: every other property would run the case again.
    """
    if backend is not None:
        spec = spec.with_(backend=backend)
    runner = runner or Runner()
    names = list(PROPERTIES) if properties is None else list(properties)
    if spec.fault == "none" and runner.offloads:
        compute_ahead(spec)  # R and B in this process while a worker runs the case
    verdicts: list[PropertyVerdict] = []
    for name in names:
        prop = get(name)
        if not prop.covers(spec):
            continue
        try:
            with stage_timing.stage("compare"):  # less the stages nested in the check
                verdicts.extend(prop.check(spec, runner))
        except ImplementationFault as fault:
            verdicts.append(fault_verdict(name, spec, fault.kind, fault.detail, fault.spec))
            break
        except Exception as exc:
            if case_of(exc) is not None or isinstance(exc, PoolError):
                raise  # the implementation or the pool: the caller's to judge
            verdicts.append(harness_error(name, spec, exc))  # the other properties go on
    return verdicts


def worst(verdicts: list[PropertyVerdict]) -> float:
    """The largest measured/allowed ratio (0 for none), capped so Hypothesis can target it."""
    return min(max((v.ratio for v in verdicts), default=0.0), 1e30)


class ExplicitFailure(BaseException):
    """An explicit example failed and the search was asked to end there (a BaseException:
    Hypothesis then runs no further example)."""

    def __init__(self, verdicts: list[PropertyVerdict]) -> None:
        self.verdicts = verdicts
        super().__init__("\n".join(v.line() for v in verdicts))


# Detail added to the verdicts of a failure Hypothesis reports as flaky.
FLAKY = "; FLAKY: the same spec then passed (non-deterministic implementation?)"
# Said of an exception `case_of` finds no spec for, where it is reported on a stand-in spec.
UNKNOWN_SPEC = "raised on an unknown spec: the spec given is a stand-in"


@dataclass
class SearchResult:
    """What one Hypothesis search found: examples run until the first failure (its shrinking
    re-runs not counted), that failure's index, the failure (verdicts of the minimal spec; when
    ``stopped``, of the latest failing spec, unshrunk), further failures (failing explicit
    examples, distinct bugs), the exceptions raised beside them, and the worst passing ratio per
    output."""

    property: str
    examples: int = 0
    first_failure_at: int | None = None
    failure: list[PropertyVerdict] = field(default_factory=list)
    worst_ratio: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    stopped: bool = False  # a deadline ended the search (see `run_property`)
    explicit_run: int = 0  # explicit examples run (the first ones of those given)
    other_failures: list[list[PropertyVerdict]] = field(default_factory=list)
    # Exceptions Hypothesis reported together with (or instead of) property failures, each with
    # the spec it was raised on (`case_of`; None: unknown, see `UNKNOWN_SPEC`).
    errors: list[tuple[CaseSpec | None, Exception]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failure and not self.errors

    @property
    def failures(self) -> list[list[PropertyVerdict]]:
        """`failure` and `other_failures`, in order."""
        return [self.failure, *self.other_failures] if self.failure else []

    def raise_errors(self) -> None:
        """Raise `errors` (one exception, or a group of them): for callers that report only
        verdicts, so an exception is never dropped."""
        if len(self.errors) == 1:
            raise self.errors[0][1]
        if self.errors:
            raise ExceptionGroup(
                f"{len(self.errors)} exceptions of a {self.property} search",
                [exc for _, exc in self.errors],
            )

    @property
    def shrunk_spec(self) -> CaseSpec | None:
        return CaseSpec.from_json(self.failure[0].spec) if self.failure else None


def run_property(
    name: str | Iterable[str],
    *,
    strategy: st.SearchStrategy[CaseSpec] | None = None,
    profile: str = "ci",
    runner: Runner | None = None,
    max_examples: int | None = None,
    seed: int | None = None,
    on_example: Callable[[CaseSpec, list[PropertyVerdict]], None] | None = None,
    shrink: bool = True,
    examples: Iterable[CaseSpec] = (),
    deadlines: tuple[float, float] = (math.inf, math.inf),
    first_failure_only: bool = False,
    explicit_until: float | None = None,
    explicit_failure_ends: bool = False,
) -> SearchResult:
    """Search ``strategy`` (default `case_specs()` at the runner's TP degrees) for a spec that
    fails property ``name`` (or any of several names), under a settings profile of
    `verify.running.profiles`. ``seed`` randomizes a derandomized profile (fresh examples per seed).
    Never raises on a property failure: the result carries the (shrunk unless ``shrink=False``)
    failing verdicts. ``examples`` run first (e.g. `verify.cases.strategies.landmark_specs`);
    several of them failing, or a profile reporting several distinct bugs, give ``other_failures``.

    When Hypothesis reports several failures at once (an exception group: failing explicit
    examples, distinct bugs, a flaky failure), every one comes back: property failures as
    verdicts (a flaky one's marked `FLAKY`), any other exception in ``errors`` with the spec it
    was raised on; a lone exception other than a property failure propagates.

    ``deadlines`` (``time.monotonic()`` seconds): the search stops after the example that ends
    past ``deadlines[0]`` while nothing has failed, or past ``deadlines[1]`` once something has
    (shrinking may run longer than searching), or at the engine's next candidate past it
    (`deadline_in_engine`: between examples); the result is then ``stopped``, with the latest
    failing verdicts unshrunk. The ``examples`` (planned coverage: landmarks, covering rows)
    run until ``explicit_until`` (default ``deadlines[1]``); ``result.explicit_run`` counts them.
    ``first_failure_only``: one bug reported, the search ends at it (the self-test's fast mode).
    ``explicit_failure_ends``: an explicit example's failure ends the search unshrunk, so the
    caller reduces it and goes on with the examples after it."""
    names = [name] if isinstance(name, str) else list(name)
    _ = [get(n) for n in names]  # an unknown name raises before any example
    runner = runner or Runner()
    if strategy is None:
        strategy = case_specs(tp_sizes=runner.tp_sizes)
    result = SearchResult(",".join(names))
    base = _search_settings(profile, max_examples, seed, shrink, first_failure_only)
    examples = list(examples)
    explicit = [len(examples)]  # explicit examples not yet run: Hypothesis runs them first

    def due() -> float:
        if explicit[0] > 0:
            return deadlines[1] if explicit_until is None else explicit_until
        return deadlines[0 if result.first_failure_at is None else 1]

    def body(spec: CaseSpec) -> None:
        planned = explicit[0] > 0
        try:
            _example(result, check_case(spec, properties=names, runner=runner), on_example, spec)
        except PropertyFailure as failure:
            if planned and explicit_failure_ends:
                raise ExplicitFailure(failure.verdicts) from failure
            raise
        finally:
            if planned:
                explicit[0] -= 1
                result.explicit_run += 1
        if time.monotonic() > due():
            raise BudgetExhausted

    search = given(strategy)(body)
    for spec in reversed(examples):
        search = example(spec)(search)
    search = settings(base)(search)
    if seed is not None:
        search = hypothesis_seed(seed)(search)
    began = time.perf_counter()
    # After one example at least (a search that starts past its deadline still runs one):
    # `examples` counts every example up to the first failure.
    with deadline_in_engine(lambda: result.examples > 0 and time.monotonic() > due()):
        _outcome(result, search)
    result.seconds = time.perf_counter() - began
    return result


def _search_settings(
    profile: str, max_examples: int | None, seed: int | None, shrink: bool, first_only: bool
) -> settings:
    """The profile's settings, without the shrink phase unless ``shrink``, reporting one bug
    when ``first_only``."""
    base = profile_settings(profile, max_examples=max_examples, seed=seed)
    if not shrink:
        base = settings(base, phases=[p for p in base.phases if p != Phase.shrink])
    if first_only:
        base = settings(base, report_multiple_bugs=False)
    return base


def _example(
    result: SearchResult,
    verdicts: list[PropertyVerdict],
    on_example: Callable[[CaseSpec, list[PropertyVerdict]], None] | None,
    spec: CaseSpec,
) -> None:
    """Tally one example's verdicts into ``result``; raise `PropertyFailure` when one failed."""
    if result.first_failure_at is None:
        result.examples += 1
    for v in verdicts:
        key = f"{v.property}:{v.output}"
        if not v.failed:
            result.worst_ratio[key] = max(result.worst_ratio.get(key, 0.0), v.ratio)
    target(worst(verdicts), label="measured/allowed")
    if on_example is not None:
        on_example(spec, verdicts)
    failed = [v for v in verdicts if v.failed]
    if failed:
        if result.first_failure_at is None:
            result.first_failure_at = result.examples
        result.failure = failed  # shrinking's best so far, kept if a deadline stops it
        # Past the deadline too: the engine stops at its next candidate. Hypothesis's final
        # replay of the shrunk failure must fail as it did, whatever the time.
        raise PropertyFailure(failed)


def _outcome(result: SearchResult, search: Callable[[], None]) -> None:
    """Run the Hypothesis ``search`` and record how it ended in ``result``."""
    try:
        search()
    except (PropertyFailure, ExplicitFailure) as failure:
        result.failure = failure.verdicts
    except BudgetExhausted:
        result.stopped = True
    except BaseExceptionGroup as group:  # explicit examples, several bugs, a stop, a flaky one
        failures = []
        for exc, flaky in leaves(group):
            if isinstance(exc, BudgetExhausted):
                result.stopped = True
            elif isinstance(exc, (PropertyFailure, ExplicitFailure)):
                note = FLAKY if flaky else ""
                failures.append([replace(v, detail=v.detail + note) for v in exc.verdicts])
            elif isinstance(exc, Exception):
                result.errors.append((case_of(exc), exc))
            else:
                raise exc from group  # a stop signal or an infrastructure fault: the caller's
        if failures:
            result.failure, result.other_failures = failures[0], failures[1:]


def seeds(first: int | None) -> Iterator[int | None]:
    """The seeds of repeated searches: ``first``, then ``first + 1``, ``first + 2``, ... (a
    search without a seed draws from the profile's own, and its repeats count from 0)."""
    yield first
    step = 1
    while True:
        yield (first or 0) + step
        step += 1


def leaves(group: BaseExceptionGroup, flaky: bool = False) -> Iterator[tuple[BaseException, bool]]:
    """The leaves of a (nested) group in order, each with whether a ``FlakyFailure`` holds it."""
    flaky = flaky or isinstance(group, FlakyFailure)
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from leaves(exc, flaky)
        else:
            yield exc, flaky
