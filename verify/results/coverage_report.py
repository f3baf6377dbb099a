"""The pairwise-coverage part of the report: which pairs of case-feature values each property
judged in each slice, against what the slice's plan (`verify.running.pairwise.SlicePlan.record`)
says it supports, and why the others were not reached.

A pair counts as reached by a property only when the property judged an example carrying both
values (a verdict of its own on that spec; a property that does not cover a spec did not try its
pairs). Records and counting only: the plan is made where the search runs.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from verify.cases import coverage
from verify.cases.coverage import Pair
from verify.cases.spec import CaseSpec

HARNESS_TIER = "harness"  # `verify.properties.verdict.HARNESS`: the harness raised, nothing judged
SHOWN = 4  # pairs not reached shown per property in the Markdown (all are in the JSON)
BUDGET_STATUSES = ("budget", "overrun", "interrupted", "skipped (budget)", "not run (interrupted)")


@dataclass
class CoverageTally:
    """The slices' plans and the pairs each property judged, one example at a time."""

    plans: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    reached: dict[tuple[str, int, str], set[Pair]] = field(default_factory=lambda: defaultdict(set))
    _pairs: dict[str, set[Pair] | None] = field(default_factory=dict)

    def add_plan(self, backend: str, tp: int, record: dict[str, Any]) -> None:
        """A slice's plan (the first one sent: concurrent searches of a slice send the same)."""
        self.plans.setdefault((backend, tp), record)

    def add_verdicts(self, backend: str, tp: int, verdicts: list[Any], example: Any) -> None:
        """The pairs of the valid spec ``example`` (a `CaseSpec`; None: each verdict's own) for
        each property with a verdict on it (the harness's own errors judged nothing)."""
        text = example.to_json() if example is not None else None
        for verdict in verdicts:
            prop, spec, tier = _fields(verdict)
            spec = text or spec
            if tier == HARNESS_TIER or spec is None:
                continue
            pairs = self._pairs_of(spec)
            if pairs:
                self.reached[(backend, tp, prop)] |= pairs

    def _pairs_of(self, spec: Any) -> set[Pair] | None:
        text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)
        if text not in self._pairs:
            if len(self._pairs) > 256:
                self._pairs.clear()
            parsed = CaseSpec.from_json(text)
            valid = parsed.fault == "none"
            self._pairs[text] = coverage.reached_pairs(parsed) if valid else None
        return self._pairs[text]


def _fields(verdict: Any) -> tuple[str, Any, str]:
    if isinstance(verdict, dict):
        return str(verdict.get("property")), verdict.get("spec"), str(verdict.get("tier"))
    return verdict.property, verdict.spec, verdict.tier


def universe(record: dict[str, Any], prop: str) -> set[Pair]:
    """The pairs property ``prop`` counts in a slice of plan ``record``: pairs of values of two
    features with more than one supported value, neither outside the property's scope, at least
    one of a feature that selects its cases (any, when none does), no invalid pair and none the
    property judges on no case (``unjudged``)."""
    domains = {name: tuple(values) for name, values in record["features"].items()}
    scope = record["properties"].get(prop)
    if scope is None:
        return set()
    outside = {tuple(v.split("=", 1)) for v in scope["outside"]}
    invalid = {item["pair"] for item in record["invalid"]}
    invalid |= set(scope.get("unjudged", ()))
    selects = set(scope["selects"])
    varying = [name for name, values in domains.items() if len(values) > 1]
    out = set()
    for a_name, b_name in itertools.combinations(varying, 2):
        if selects and not ({a_name, b_name} & selects):
            continue
        for a, b in itertools.product(domains[a_name], domains[b_name]):
            if (a_name, a) in outside or (b_name, b) in outside:
                continue
            p = coverage.pair((a_name, a), (b_name, b))
            if coverage.pair_text(p) not in invalid:
                out.add(p)
    return out


def to_json(tally: CoverageTally, slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per planned slice: its plan's reasons and, per property, pairs reached of
    those it counts, the pairs not reached with the reason, and the values outside its scope."""
    statuses = {(s["backend"], s["tp"]): s["status"] for s in slices}
    out = []
    for (backend, tp), record in sorted(tally.plans.items()):
        late = statuses.get((backend, tp)) in BUDGET_STATUSES
        reason = "not reached in budget" if late else "not reached (no judged example had it)"
        properties = []
        for prop in record["properties"]:
            counted = universe(record, prop)
            reached = tally.reached.get((backend, tp, prop), set()) & counted
            missing = sorted(coverage.pair_text(p) for p in counted - reached)
            properties.append({
                "property": prop,
                "reached": len(reached),
                "supported": len(counted),
                "not_reached": [{"pair": text, "reason": reason} for text in missing],
                "outside": record["properties"][prop]["outside"],
                "unjudged": record["properties"][prop].get("unjudged", []),
            })  # fmt: skip
        out.append({
            "backend": backend, "tp": tp, "rows": record["rows"],
            "features": record["features"], "not_claimed": record["not_claimed"],
            "invalid": record["invalid"], "properties": properties,
        })  # fmt: skip
    return out


def markdown(entries: list[dict[str, Any]]) -> list[str]:
    """The coverage section: per slice, what is not supported and why, then a line per
    property (reached / supported, the first pairs not reached, the values outside it)."""
    if not entries:
        return []
    lines = [
        "## Pairwise coverage per slice and property",
        "",
        "A pair of case-feature values counts when the property judged an example carrying both."
        " Supported: the pairs of the values the implementation claims here that the property"
        " judges (for one judging part of the slice, the pairs through the values that select"
        " it). The full lists are in report.json.",
        "",
    ]
    for entry in entries:
        lines += [f"### {entry['backend']} TP={entry['tp']} ({entry['rows']} covering rows)", ""]
        lines += _unsupported_lines(entry)
        lines += ["| property | reached / supported | not reached | outside the property |"]
        lines += ["| --- | --- | --- | --- |"]
        for prop in entry["properties"]:
            missing = prop["not_reached"]
            shown = ", ".join(f"`{m['pair']}`" for m in missing[:SHOWN])
            if len(missing) > SHOWN:
                shown += f" (+{len(missing) - SHOWN} more)"
            reason = f"{missing[0]['reason']}: {shown}" if missing else "-"
            percent = 100.0 * prop["reached"] / prop["supported"] if prop["supported"] else 100.0
            outside = ", ".join(prop["outside"]) or "-"
            counts = f"{prop['reached']} / {prop['supported']} ({percent:.0f}%)"
            lines.append(f"| {prop['property']} | {counts} | {reason} | {outside} |")
        lines.append("")
    return lines


def _unsupported_lines(entry: dict[str, Any]) -> list[str]:
    claimed = [f"`{c['value']}` ({c['reason']})" for c in entry["not_claimed"]]
    invalid = sorted({f"`{c['pair']}`" for c in entry["invalid"]})
    lines = []
    if claimed:
        lines.append("- values not supported here: " + ", ".join(claimed))
    if invalid:
        lines.append("- pairs no valid case has: " + ", ".join(invalid))
    return [*lines, ""] if lines else []
