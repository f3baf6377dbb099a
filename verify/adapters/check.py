"""Verify one implementation: search every applicable property through its adapter, save failures.

`check_impl` runs the engine's `run_property` per property on `specs_for(adapter)`, either once
under the profile (``minutes=None``: the ``ci`` way, bounded examples) or in seeded batches until a
time budget is spent (the ``nightly`` way). In a timed search a failure does not end the property:
later batches leave out the failure's trigger (`trigger`), so one cheap failure cannot hide the
others. The implementation raising on a valid case (an undeclared limit) is reported once, and
every later search leaves it out (`Refusals`). An exception of the harness's own code becomes
that property's ``harness`` verdict, with its traceback; the other properties go on. Each shrunk
failure becomes a failure artifact (the engine's format plus ``impl``) that
`verify.adapters.replay_impl` re-runs.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from hypothesis.errors import Unsatisfiable

from verify.adapters.filtering import (
    Untested,
    backends_for,
    coerce,
    invalid_specs_for,
    not_tested,
    properties_for,
    specs_for,
)
from verify.cases.spec import CaseSpec
from verify.cases.strategies import landmark_specs
from verify.distributed.seam import Pool
from verify.execution.interface import Adapter
from verify.execution.runner import Runner, case_of
from verify.execution.selection import resolve
from verify.properties.verdict import HARNESS, PropertyVerdict, harness_error, is_refusal
from verify.results import artifacts
from verify.running.engine import (
    UNKNOWN_SPEC,
    SearchResult,
    run_property,
    search_rounds,
    seeds,
)

BATCH_EXAMPLES = 20  # examples per seeded batch of a timed search
MAX_FAILURES = 3  # distinct failures a timed search collects per property
# Spec fields whose non-default value in a shrunk failure marks what triggered it (sizes and
# numbers are left out: they shrink on their own; transform/fault/backend are set by properties).
SIZES = ("tokens", "hidden_size", "vocab")
_NOT_TRIGGERS = (*SIZES, "seed", "scale", "offset", "chunk_size")
TRIGGER_FIELDS = tuple(
    f.name
    for f in fields(CaseSpec)
    if f.name not in (*_NOT_TRIGGERS, "transform", "fault", "backend")
)


@dataclass(frozen=True)
class Failure:
    """One shrunk failure: its failing verdicts and, when saved, the artifact path."""

    verdicts: list[PropertyVerdict]
    artifact: str | None = None

    @property
    def spec(self) -> CaseSpec:
        return CaseSpec.from_json(self.verdicts[0].spec)

    @property
    def refusal(self) -> bool:
        """The implementation raised on a valid case (every failing verdict says so)."""
        return all(is_refusal(v) for v in self.verdicts)


@dataclass
class PropertyOutcome:
    """One property's search: examples, time, worst passing ratios, and its failures."""

    property: str
    examples: int = 0
    seconds: float = 0.0
    worst_ratio: dict[str, float] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def merge(self, result: SearchResult) -> None:
        """Add one batch's tally and failures, and each exception it raised as a harness error
        on its own spec (the simplest spec when unknown, said in the verdict)."""
        self.examples += result.examples
        self.failures += [Failure(verdicts) for verdicts in result.failures]
        for spec, exc in result.errors:
            verdict = harness_error(self.property, spec or CaseSpec(), exc)
            if spec is None:
                verdict = replace(verdict, detail=f"{verdict.detail}; {UNKNOWN_SPEC}")
            self.failures.append(Failure([verdict]))
        for key, ratio in result.worst_ratio.items():
            self.worst_ratio[key] = max(self.worst_ratio.get(key, 0.0), ratio)

    @property
    def vacuous(self) -> bool:
        """Ran, but no generated case gave the property a verdict (nothing was checked)."""
        return not self.failures and not self.worst_ratio


@dataclass
class ImplReport:
    """Everything `check_impl` found for one adapter."""

    adapter: Adapter
    profile: str
    outcomes: list[PropertyOutcome]
    untested: list[Untested]

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outcomes)

    @property
    def implementation_failed(self) -> bool:
        """A failure that is a verdict on the implementation (not a harness error)."""
        return any(v.tier != HARNESS for o in self.outcomes for f in o.failures for v in f.verdicts)

    @property
    def harness_errors(self) -> list[PropertyVerdict]:
        """Verdicts recording an exception of the harness's own code (with its traceback)."""
        return [
            v for o in self.outcomes for f in o.failures for v in f.verdicts if v.tier == HARNESS
        ]

    def failure_lines(self) -> list[str]:
        """One line per failing verdict, with its artifact path."""
        return [
            f"{v.line()} artifact={f.artifact}"
            for o in self.outcomes
            for f in o.failures
            for v in f.verdicts
        ]


def check_impl(
    impl: str | Adapter,
    *,
    profile: str = "ci",
    properties: Iterable[str] | None = None,
    max_examples: int | None = None,
    minutes: float | None = None,
    pool: Pool | None = None,
    failures_dir: Path | str | None = None,
    seed: int = 0,
    spec_filter: Callable[[CaseSpec], bool] | None = None,
    landmarks: bool = True,
) -> ImplReport:
    """Search ``properties`` (default: all that apply) on ``impl``; TP > 1 needs ``pool``.

    ``minutes`` bounds the whole search (shared out among the properties still to run); without
    it each property runs the profile's example count once. Failures are written as artifacts
    into ``failures_dir`` when given. ``spec_filter`` narrows the search (e.g. to leave out a
    regime with an open, reported finding). ``landmarks``: every search starts with the engine's
    landmark specs (one per input class of docs/DESIGN.md), mapped to what the adapter supports.
    """
    adapter = resolve(impl)
    runner = Runner(pool, adapter=adapter)
    tp_sizes = runner.tp_sizes
    names = list(properties) if properties is not None else list(properties_for(adapter, tp_sizes))
    deadline = None if minutes is None else time.monotonic() + 60.0 * minutes
    keep = spec_filter or (lambda spec: True)
    firsts = _landmarks(adapter, tp_sizes, keep) if landmarks else []
    refusals = Refusals(adapter, runner)
    outcomes, out_of_time = [], []
    for index, name in enumerate(names):
        if deadline is not None and time.monotonic() >= deadline:
            out_of_time.append(Untested(f"property {name}", "not run: the time budget was spent"))
            continue
        if refusals.everything:
            reason = f"not run: the simplest case was refused (see {refusals.everything})"
            out_of_time.append(Untested(f"property {name}", reason))
            continue
        strategy = invalid_specs_for(adapter) if name == "status" else specs_for(adapter, tp_sizes)
        strategy = strategy.filter(keep)
        search = _Search(
            name, strategy, runner, profile, max_examples,
            [] if name == "status" else firsts, refusals,
        )  # fmt: skip
        outcome = PropertyOutcome(name)
        began = time.monotonic()
        if deadline is None:
            # Each new refusal is reported once; the search then goes on without its trigger
            # (the profile's own examples again, now inside the accepted region).
            def again(_: int, search=search, outcome=outcome) -> bool:
                search.batch(outcome, None)
                return refusals.absorb(outcome)

            with contextlib.suppress(Unsatisfiable):  # refusals left nothing to draw
                search_rounds(range(MAX_FAILURES), again)
        else:
            share = max(deadline - began, 0.0) / (len(names) - index)
            _timed(outcome, adapter, search, share, seed, deadline)
        outcome.seconds = time.monotonic() - began
        if failures_dir is not None:
            outcome.failures = [
                Failure(f.verdicts, str(save_failure(adapter, name, f, failures_dir)))
                for f in outcome.failures
            ]
        outcomes.append(outcome)
    vacuous = [
        Untested(f"property {o.property}", "ran, but no generated case gave it a verdict")
        for o in outcomes
        if o.vacuous
    ]
    untested = not_tested(adapter, tp_sizes) + out_of_time + vacuous
    return ImplReport(adapter, profile, outcomes, untested)


def _landmarks(adapter: Adapter, tp_sizes: tuple[int, ...], keep) -> list[CaseSpec]:
    """The engine's landmark specs mapped to the adapter (duplicates and filtered-out dropped)."""
    backend = backends_for(adapter)[0]
    mapped = [coerce(adapter, s.with_(backend=backend)) for s in landmark_specs(tp_sizes)]
    return [s for i, s in enumerate(mapped) if s not in mapped[:i] and keep(s)]


@dataclass
class Refusals:
    """Undeclared refusals found so far (the implementation raised on a valid case). Each is
    reported once, by the property that found it first; every later search leaves its trigger
    out, so the properties go on inside the region the implementation accepts instead of all
    shrinking to the same refusal. ``everything``: the property whose search found the simplest
    case refused (nothing left to search)."""

    adapter: Adapter
    runner: Any
    triggers: list[dict[str, Any]] = field(default_factory=list)
    reported: list[Failure] = field(default_factory=list)
    everything: str = ""

    def allows(self, spec: CaseSpec) -> bool:
        return not any(_has(spec, found) for found in self.triggers)

    def trigger(self, spec: CaseSpec) -> dict[str, Any]:
        """The fields of a refused ``spec`` the refusal needs, sizes included: each field away
        from the simplest spec's value whose simplest value makes the implementation accept the
        case (a kernel refusing 1 token, say). Landmark specs are not shrunk, so each field is
        tried, not assumed."""
        simplest = coerce(self.adapter, CaseSpec())
        found = {}
        for name in (*SIZES, *TRIGGER_FIELDS):
            value = getattr(spec, name)
            if value == getattr(simplest, name):
                continue
            try:
                probe = spec.with_(**{name: getattr(simplest, name)})
            except ValueError:
                found[name] = value  # e.g. vocab < tp: cannot tell, keep it
                continue
            outside = self.adapter.capabilities.limits.violations(probe)
            if outside or self.runner.run(probe).status == "ok":
                found[name] = value
        return found

    def absorb(self, outcome: PropertyOutcome) -> bool:
        """Record ``outcome``'s refusals, dropping those already reported; returns whether a new
        one with a trigger to leave out was found (a further search can then go on)."""
        kept, new = [], False
        for failure in outcome.failures:
            if not failure.refusal or any(failure is seen for seen in self.reported):
                kept.append(failure)
                continue
            found = self.trigger(failure.spec)
            if found in self.triggers or (not found and self.everything):
                continue
            kept.append(failure)
            self.reported.append(failure)
            if found:
                self.triggers.append(found)
                new = True
            else:
                self.everything = outcome.property
        outcome.failures = kept
        return new


@dataclass
class _Search:
    """One property's search settings; `batch` runs it once and merges into an outcome."""

    name: str
    strategy: Any
    runner: Any
    profile: str
    max_examples: int | None
    examples: list[CaseSpec]
    refusals: Refusals

    def batch(
        self,
        outcome: PropertyOutcome,
        seed: int | None,
        strategy=None,
        deadlines: tuple[float, float] = (math.inf, math.inf),
    ) -> bool:
        """One `run_property` call (the landmarks run in the first one only) under ``deadlines``
        (see there), merged into ``outcome``. Returns whether it ran to its end."""
        examples, self.examples = self.examples, []
        examples = [spec for spec in examples if self.refusals.allows(spec)]
        strategy = self.strategy if strategy is None else strategy
        strategy = strategy.filter(self.refusals.allows)
        try:
            result = run_property(
                self.name, strategy=strategy, profile=self.profile, runner=self.runner,
                max_examples=self.max_examples, seed=seed, examples=examples,
                deadlines=deadlines,
            )  # fmt: skip
        except Unsatisfiable:
            raise  # the caller's filters left nothing to draw
        except Exception as exc:  # the adapter's exceptions are verdicts: this is the harness's
            result = SearchResult(self.name, errors=[(case_of(exc), exc)])
        outcome.merge(result)
        return not result.stopped


def _timed(outcome, adapter, search: _Search, share: float, seed: int, deadline: float) -> None:
    """Seeded batches (at least one example) until ``share`` seconds are spent or `MAX_FAILURES`
    distinct failures are found; shrinking a failure may go on to ``deadline`` (the whole
    search's end)."""
    began = time.monotonic()
    if search.max_examples is None:
        search.max_examples = BATCH_EXAMPLES

    def batch(seed: int | None) -> bool:
        if len(outcome.failures) >= MAX_FAILURES or search.refusals.everything:
            return False
        # Refusals are left out by `Refusals.allows` (their triggers include sizes).
        found = [trigger(adapter, f.spec) for f in outcome.failures if not f.refusal]
        if any(not t for t in found):
            return False  # a failure with no trigger to leave out: every later batch repeats it
        narrowed = search.strategy.filter(lambda s: not any(_has(s, t) for t in found))
        try:
            finished = search.batch(outcome, seed, narrowed, (began + share, deadline))
        except Unsatisfiable:
            return False  # the triggers left out every spec the strategy can draw
        search.refusals.absorb(outcome)
        return finished and time.monotonic() - began < share

    search_rounds(seeds(seed), batch)


def trigger(adapter: Adapter, spec: CaseSpec) -> dict[str, Any]:
    """The fields of a shrunk ``spec`` that differ from the simplest spec the adapter gets:
    shrinking moves every field it can back to its default, so these are what the failure needs."""
    simplest = coerce(adapter, CaseSpec())
    found = {
        name: getattr(spec, name)
        for name in TRIGGER_FIELDS
        if getattr(spec, name) != getattr(simplest, name)
    }
    if spec.tokens == 0:
        found["tokens"] = 0  # empty input: a class of its own
    return found


def _has(spec: CaseSpec, found: dict[str, Any]) -> bool:
    return all(getattr(spec, name) == value for name, value in found.items())


def save_failure(adapter: Adapter, prop: str, failure: Failure, failures_dir: Path | str) -> Path:
    """Write a shrunk failure as an artifact naming the implementation (``impl``)."""
    spec = failure.spec
    record = artifacts.make_record(spec, prop, failure.verdicts, shrunk=True, device=adapter.device)
    record["backend"] = adapter.label(spec.backend)
    record["impl"] = adapter.ref or adapter.name
    return artifacts.write(record, failures_dir)
