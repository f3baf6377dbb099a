"""An `ImplReport` as JSON and as Markdown: what passed, each failure with its artifact, shrunk
spec and measured vs allowed error, and what was not tested."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from verify.adapters.check import ImplReport
from verify.results.artifacts import json_number, verdict_record


def to_json(report: ImplReport) -> dict[str, Any]:
    """A JSON-safe dict of ``report`` (non-finite numbers as strings, see `json_number`)."""
    adapter = report.adapter
    return {
        "impl": adapter.ref or adapter.name,
        "name": adapter.name,
        "description": adapter.description,
        "device": adapter.device,
        "outputs": list(adapter.outputs),
        "contract": asdict(adapter.contract),
        "capabilities": asdict(adapter.capabilities),
        "profile": report.profile,
        "passed": report.passed,
        "properties": [
            {
                "property": o.property,
                "passed": o.passed,
                "vacuous": o.vacuous,
                "examples": o.examples,
                "seconds": round(o.seconds, 2),
                "worst_ratio": {k: json_number(v) for k, v in sorted(o.worst_ratio.items())},
                "failures": [
                    {
                        "artifact": f.artifact,
                        "spec": json.loads(f.verdicts[0].spec),
                        "verdicts": [verdict_record(v) for v in f.verdicts],
                    }
                    for f in o.failures
                ],
            }
            for o in report.outcomes
        ],
        "not_tested": [{"what": u.what, "reason": u.reason} for u in report.untested],
    }


def to_markdown(report: ImplReport) -> str:
    """A section a person can scan: one row per property, then failures, then the gaps."""
    adapter = report.adapter
    lines = [
        f"## {adapter.name}: {'passed' if report.passed else 'FAILED'}",
        "",
        f"- implementation: `{adapter.description or adapter.ref}` on {adapter.device}",
        f"- contract: logits {adapter.contract.logits}, outputs {adapter.contract.outputs}; "
        f"profile `{report.profile}`",
        "",
        "| property | result | examples | seconds | worst passing ratio |",
        "|---|---|---|---|---|",
    ]
    for o in report.outcomes:
        worst = max(o.worst_ratio.items(), key=lambda kv: kv[1], default=None)
        shown = f"{worst[1]:.3g} ({worst[0]})" if worst else "-"
        state = "no verdict" if o.vacuous else ("pass" if o.passed else f"FAIL ({len(o.failures)})")
        lines.append(f"| {o.property} | {state} | {o.examples} | {o.seconds:.1f} | {shown} |")
    failures = [(o.property, f) for o in report.outcomes for f in o.failures]
    if failures:
        lines += ["", "### Failures", ""]
    for prop, failure in failures:
        lines.append(f"- **{prop}**, artifact `{failure.artifact}`")
        lines.append(f"  - shrunk spec: `{failure.verdicts[0].spec}`")
        for v in failure.verdicts:
            lines.append(
                f"  - {v.output} [{v.tier}]: measured {v.measured:.4g} vs allowed "
                f"{v.allowed:.4g} ({v.detail})"
            )
    if report.untested:
        lines += ["", "### Not tested", ""]
        lines += [f"- {u.line()}" for u in report.untested]
    return "\n".join(lines) + "\n"
