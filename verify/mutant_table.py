"""The mutation self-test as a table: plant each bug of `verify.mutants`, search with a profile, and
report whether a property killed it, after how many examples, and the shrunk spec that did.

A kill's shrunk spec can be saved as a failure artifact (with its mutant named): the regression
corpus keeps them, so `corpus` checks both that the code passes them and that each bug is still
caught by them.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verify import artifacts
from verify.campaign import search
from verify.mutants import MUTANTS
from verify.properties.registry import PROPERTIES
from verify.properties.runner import Runner
from verify.strategies import case_specs


@dataclass(frozen=True)
class MutantOutcome:
    """One mutant's search: ``killed_by`` failing properties, ``first_failure_at`` examples until
    the first failure, ``examples`` including shrinking, the shrunk ``spec`` JSON."""

    name: str
    bug: str
    killed: bool
    killed_by: list[str]
    first_failure_at: int | None
    examples: int
    seconds: float
    spec: str | None
    artifact: str | None
    error: str | None = None  # the search raised (a harness error, not a kill)


def kill_mutants(
    names: list[str],
    *,
    profile: str,
    backend: str,
    tp_sizes: tuple[int, ...],
    pool: Any | None,
    save_dir: Path | None = None,
    device: str = "cpu",
) -> list[MutantOutcome]:
    """Search for each mutant in ``names`` with every property but status (valid cases only)."""
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        raise ValueError(f"unknown mutant(s) {unknown}; known: {', '.join(MUTANTS)}")
    properties = [p for p in PROPERTIES if p != "status"]
    outcomes = []
    for name in names:
        runner = Runner(pool, name)
        began = time.monotonic()
        try:
            result = search(
                properties,
                strategy=case_specs(backends=(backend,), tp_sizes=tp_sizes),
                profile=profile,
                runner=runner,
            )
        except Exception as exc:  # the harness itself broke: a row saying so, then the next
            error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            outcomes.append(_errored(name, error, time.monotonic() - began))
            continue
        seconds = time.monotonic() - began
        spec = result.shrunk_spec
        by = sorted({v.property for v in result.failure})
        path = None
        if spec is not None and save_dir is not None:
            record = artifacts.make_record(
                spec,
                ",".join(by),
                result.failure,
                shrunk=True,
                device=device,
                mutant=name,
                examples=result.first_failure_at,
            )
            path = str(artifacts.write(record, save_dir))
        outcomes.append(
            MutantOutcome(
                name,
                MUTANTS[name].bug,
                not result.passed,
                by,
                result.first_failure_at,
                result.examples,
                round(seconds, 2),
                spec.to_json() if spec else None,
                path,
            )
        )
    return outcomes


def _errored(name: str, error: str, seconds: float) -> MutantOutcome:
    bug = MUTANTS[name].bug
    return MutantOutcome(name, bug, False, [], None, 0, round(seconds, 2), None, None, error)


def table(outcomes: list[MutantOutcome]) -> list[str]:
    """A Markdown table: mutant, killed, by which properties, examples, seconds, shrunk spec."""
    lines = [
        "| mutant | killed | by | first failure at | examples (with shrinking) | s | shrunk spec |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for o in outcomes:
        spec = _short_spec(o.spec) if o.spec else (f"error: {o.error}" if o.error else "-")
        lines.append(
            f"| {o.name} | {'yes' if o.killed else '**NO**'} | {', '.join(o.killed_by) or '-'} "
            f"| {o.first_failure_at or '-'} | {o.examples} | {o.seconds:.1f} | {spec} |"
        )
    killed = sum(o.killed for o in outcomes)
    lines.append("")
    lines.append(f"{killed}/{len(outcomes)} mutants killed")
    return lines


def write_json(outcomes: list[MutantOutcome], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(o) for o in outcomes], indent=1) + "\n")


def _short_spec(spec_json: str) -> str:
    """The spec's fields that differ from CaseSpec's defaults: what a reader needs to see."""
    from verify.spec import CaseSpec

    spec, default = json.loads(spec_json), json.loads(CaseSpec().to_json())
    changed = {k: v for k, v in spec.items() if default.get(k) != v}
    return "`" + json.dumps(changed, separators=(",", ":")) + "`"
