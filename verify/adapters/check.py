"""Verify one implementation: search every applicable property through its adapter, save failures.

`check_impl` runs the engine's `run_property` per property on `specs_for(adapter)`, either once
under the profile (``minutes=None``: the ``ci`` way, bounded examples) or in seeded batches until a
time budget is spent (the ``nightly`` way). Each shrunk failure becomes a failure artifact (the
engine's format, plus ``impl``) that `verify.adapters.replay` re-runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verify import artifacts
from verify.adapters.filtering import (
    Untested,
    invalid_specs_for,
    not_tested,
    properties_for,
    specs_for,
)
from verify.adapters.protocol import Adapter
from verify.adapters.registry import resolve
from verify.adapters.runner import adapter_runner
from verify.engine import SearchResult, run_property
from verify.properties.verdict import PropertyVerdict
from verify.spec import CaseSpec

BATCH_EXAMPLES = 20  # examples per seeded batch of a time-bounded search


@dataclass
class PropertyOutcome:
    """One property's search: examples, time, worst passing ratios, and its failure if any."""

    property: str
    examples: int = 0
    seconds: float = 0.0
    known: int = 0
    worst_ratio: dict[str, float] = field(default_factory=dict)
    failure: list[PropertyVerdict] = field(default_factory=list)
    artifact: str | None = None

    @property
    def passed(self) -> bool:
        return not self.failure


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

    def failure_lines(self) -> list[str]:
        """One line per failing verdict, with its artifact path."""
        return [f"{v.line()} artifact={o.artifact}" for o in self.outcomes for v in o.failure]


def check_impl(
    impl: str | Adapter,
    *,
    profile: str = "ci",
    properties: Iterable[str] | None = None,
    max_examples: int | None = None,
    minutes: float | None = None,
    pool: Any | None = None,
    failures_dir: Path | str | None = None,
    seed: int = 0,
    spec_filter: Callable[[CaseSpec], bool] | None = None,
) -> ImplReport:
    """Search ``properties`` (default: all that apply) on ``impl``; TP > 1 needs ``pool``.

    ``minutes`` bounds the whole search (shared out among the properties still to run); without
    it each property runs the profile's example count once. Failures are written as artifacts
    into ``failures_dir`` when given. ``spec_filter`` narrows the search (e.g. to leave out a
    regime with an open, reported finding).
    """
    adapter = resolve(impl)
    runner = adapter_runner(adapter, pool)
    tp_sizes = runner.tp_sizes
    names = list(properties) if properties is not None else list(properties_for(adapter, tp_sizes))
    deadline = None if minutes is None else time.monotonic() + 60.0 * minutes
    outcomes = []
    for index, name in enumerate(names):
        strategy = invalid_specs_for(adapter) if name == "status" else specs_for(adapter, tp_sizes)
        if spec_filter is not None:
            strategy = strategy.filter(spec_filter)
        share = None
        if deadline is not None:
            share = max(deadline - time.monotonic(), 0.0) / (len(names) - index)
        outcome = _search(name, strategy, runner, profile, max_examples, share, seed)
        if outcome.failure and failures_dir is not None:
            outcome.artifact = str(save_failure(adapter, outcome, failures_dir))
        outcomes.append(outcome)
    return ImplReport(adapter, profile, outcomes, not_tested(adapter, tp_sizes))


def _search(name, strategy, runner, profile, max_examples, share, seed) -> PropertyOutcome:
    outcome = PropertyOutcome(name)
    began = time.monotonic()
    batch = 0
    while True:
        if share is None:
            result = run_property(
                name, strategy=strategy, profile=profile, runner=runner, max_examples=max_examples
            )
        else:
            result = run_property(
                name, strategy=strategy, profile=profile, runner=runner,
                max_examples=max_examples or BATCH_EXAMPLES, seed=seed + batch,
            )  # fmt: skip
        _merge(outcome, result)
        batch += 1
        if share is None or outcome.failure or time.monotonic() - began >= share:
            break
    outcome.seconds = time.monotonic() - began
    return outcome


def _merge(outcome: PropertyOutcome, result: SearchResult) -> None:
    outcome.examples += result.examples
    outcome.known += result.known
    outcome.failure = result.failure
    for key, ratio in result.worst_ratio.items():
        outcome.worst_ratio[key] = max(outcome.worst_ratio.get(key, 0.0), ratio)


def save_failure(adapter: Adapter, outcome: PropertyOutcome, failures_dir: Path | str) -> Path:
    """Write ``outcome``'s shrunk failure as an artifact naming the implementation (``impl``)."""
    spec = CaseSpec.from_json(outcome.failure[0].spec)
    record = artifacts.make_record(
        spec, outcome.property, outcome.failure, shrunk=True,
        device=adapter.device, examples=outcome.examples,
    )  # fmt: skip
    record["backend"] = adapter.label(spec.backend)
    record["impl"] = adapter.ref or adapter.name
    return artifacts.write(record, failures_dir)
