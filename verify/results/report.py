"""The campaign report: a `Tally` of every checked example, written as JSON, Markdown and a PNG.

The JSON (schema in docs/report-format.md) holds examples per property x dtype x backend x TP, the
worst measured/allowed ratio per output x dtype x backend, and every failure with its artifact;
the Markdown is the short version a person scans; the PNG shows how close to the line each sits.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verify.adapters.interface import Adapter
from verify.execution.stage_timing import STAGES
from verify.results import coverage_report
from verify.results.artifacts import is_failure, json_number, verdict_record

SCHEMA = "lce-campaign-report"
# 2: one report for every implementation (implementation, not_tested, outcome); 3: coverage
SCHEMA_VERSION = 3
SAMPLES_PER_CELL = 400  # ratios kept per output x dtype x backend for the plot (reservoir sample)
PLOT_FILE = "ratios.png"
# Outputs judged by measured/allowed against a tolerances.yaml entry; the worst table and the plot
# show these (the loss_ ones are gradients of the reduced loss).
RATIO_OUTPUTS = (
    "logprobs",
    "entropy",
    "loss",
    "grad_hidden",
    "grad_weight",
    "grad_bias",
    "loss_grad_hidden",
    "loss_grad_weight",
    "loss_grad_bias",
)


@dataclass
class Cell:
    """Worst verdict and a sample of ratios of one output x dtype x backend."""

    worst: dict[str, Any] | None = None
    ratios: list[float] = field(default_factory=list)
    seen: int = 0


@dataclass
class Tally:
    """Everything the report needs, accumulated one example at a time (driver process only)."""

    # (property, dtype, backend, tp) -> [examples, failing examples]
    counts: dict[tuple[str, str, str, int], list[int]] = field(
        default_factory=lambda: defaultdict(lambda: [0, 0])
    )
    # (dtype, backend, tp) -> [examples, failing examples]
    by_dtype: dict[tuple[str, str, int], list[int]] = field(
        default_factory=lambda: defaultdict(lambda: [0, 0])
    )
    # (extent, backend, tp) -> [examples, failing examples]: `verify.cases.spec.EXTENTS`
    by_extent: dict[tuple[str, str, int], list[int]] = field(
        default_factory=lambda: defaultdict(lambda: [0, 0])
    )
    cells: dict[tuple[str, str, str], Cell] = field(default_factory=lambda: defaultdict(Cell))
    failures: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    slices: list[dict[str, Any]] = field(default_factory=list)
    # (backend, kind) -> examples, compiles, wall and stage seconds; kind: "numerical" or "status"
    timing: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    examples: int = 0
    # The slices' pairwise-coverage plans and the pairs each property judged
    coverage: coverage_report.CoverageTally = field(default_factory=coverage_report.CoverageTally)
    _rng: random.Random = field(default_factory=lambda: random.Random(0))

    def add_coverage(self, backend: str, tp: int, record: dict[str, Any]) -> None:
        """A slice's pairwise-coverage plan (`verify.running.pairwise.SlicePlan.record`)."""
        self.coverage.add_plan(backend, tp, record)

    def add_example(
        self, dtype: str, backend: str, tp: int, verdicts: list[Any], spec: Any = None
    ) -> None:
        """Record one checked example: its verdicts (objects or dicts) from every property, and
        its spec (a property with a verdict judged its pairs; without a spec, each verdict's)."""
        self.examples += 1
        self.coverage.add_verdicts(backend, tp, verdicts, spec)
        records = [verdict_record(v) for v in verdicts]
        failed = any(is_failure(r) for r in records)
        self.by_dtype[(dtype, backend, tp)][0] += 1
        self.by_dtype[(dtype, backend, tp)][1] += int(failed)
        if spec is not None:
            self.by_extent[(spec.extent, backend, tp)][0] += 1
            self.by_extent[(spec.extent, backend, tp)][1] += int(failed)
        by_property: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for record in records:
            by_property[str(record.get("property"))].append(record)
        for prop, records in by_property.items():
            counts = self.counts[(prop, dtype, backend, tp)]
            counts[0] += 1
            counts[1] += int(any(is_failure(r) for r in records))
            for record in records:
                self._add_ratio(prop, dtype, backend, tp, record)

    def add_timing(
        self,
        backend: str,
        kind: str,
        taken: dict[str, Any],
        wall_s: float,
        *,
        ended: float | None = None,
    ) -> None:
        """One example's `verify.execution.stage_timing` split (``taken``) and its wall time; the
        wall time no stage claimed is counted as ``other``. ``ended`` (``time.monotonic()``,
        default now) places the example on the clock, so examples of concurrent searches are
        counted once in the row's ``clock_s``."""
        row = self.timing.setdefault(
            (backend, kind),
            {"examples": 0, "compiles": 0, "wall_s": 0.0, "seconds": {}, "spans": []},
        )
        row["examples"] += 1
        row["compiles"] += taken["compiles"]
        row["wall_s"] += wall_s
        ended = time.monotonic() if ended is None else ended
        row["spans"].append((ended - wall_s, ended))
        seconds = dict(taken["seconds"])
        seconds["other"] = seconds.get("other", 0.0) + max(0.0, wall_s - sum(seconds.values()))
        for name, value in seconds.items():
            row["seconds"][name] = row["seconds"].get(name, 0.0) + value

    def add_failure(self, failure: dict[str, Any]) -> None:
        """A saved failure: property, backend, tp, dtype, output, ratio, artifact, shrunk, line.
        One row per artifact file: concurrent searches that save the same case write one file."""
        if all(f.get("artifact") != failure.get("artifact") for f in self.failures):
            self.failures.append(failure)

    def add_error(self, where: str, message: str) -> None:
        """An infrastructure error (a rank died or hung, a slice could not run)."""
        self.errors.append({"where": where, "message": message})

    def _add_ratio(self, prop: str, dtype: str, backend: str, tp: int, record: dict) -> None:
        output = str(record.get("output"))
        if output not in RATIO_OUTPUTS:  # yes/no clauses (dtypes, ignored rows) have no ratio scale
            return
        ratio = float(record.get("ratio", 0.0))
        cell = self.cells[(output, dtype, backend)]
        cell.seen += 1
        sample = ratio
        if len(cell.ratios) < SAMPLES_PER_CELL:
            cell.ratios.append(sample)
        else:
            slot = self._rng.randrange(cell.seen)
            if slot < SAMPLES_PER_CELL:
                cell.ratios[slot] = sample
        worst = cell.worst
        if worst is None or order(ratio) > order(float(worst["ratio"])):
            cell.worst = {
                "ratio": json_number(ratio),
                "measured": record.get("measured"),
                "allowed": record.get("allowed"),
                "tier": record.get("tier"),
                "property": prop,
                "tp": tp,
                "detail": record.get("detail"),
            }


def to_json(tally: Tally, meta: dict[str, Any]) -> dict[str, Any]:
    """The report document: ``meta`` (profile, budget, timing, environment) plus the tally."""
    counts = [
        {"property": p, "dtype": d, "backend": b, "tp": t, "examples": n, "failures": f}
        for (p, d, b, t), (n, f) in sorted(tally.counts.items())
    ]
    by_dtype = [
        {"dtype": d, "backend": b, "tp": t, "examples": n, "failures": f}
        for (d, b, t), (n, f) in sorted(tally.by_dtype.items())
    ]
    by_extent = [
        {"extent": e, "backend": b, "tp": t, "examples": n, "failures": f}
        for (e, b, t), (n, f) in sorted(tally.by_extent.items())
    ]
    worst = [
        {"output": o, "dtype": d, "backend": b, "checks": c.seen, **(c.worst or {})}
        for (o, d, b), c in sorted(tally.cells.items())
    ]
    examples = tally.examples
    wall = float(meta.get("wall_s") or 0.0)
    result = outcome(tally.failures, tally.errors, meta.get("interrupted"))
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        **meta,
        "examples": examples,
        "examples_per_s": round(examples / wall, 3) if wall > 0 else None,
        "outcome": result,
        "passed": result == "passed",
        "slices": tally.slices,
        "timing": [_timing_row(b, k, row) for (b, k), row in sorted(tally.timing.items())],
        "counts": counts,
        "examples_by_dtype": by_dtype,
        "examples_by_extent": by_extent,
        "worst": worst,
        "failures": tally.failures,
        "errors": tally.errors,
        "coverage": coverage_report.to_json(tally.coverage, tally.slices),
    }


def outcome(failures: list[dict], errors: list[dict], interrupted: str | None) -> str:
    """``failed`` (a check failed, or the harness raised), ``interrupted``, ``incomplete`` (no
    check failed, but the workers or the machine faulted: infrastructure) or ``passed``."""
    if failures:
        return "failed"
    if interrupted:
        return "interrupted"
    return "incomplete" if errors else "passed"


HEADLINES = {
    "passed": "PASSED",
    "failed": "FAILED",
    "incomplete": "INCOMPLETE (infrastructure: no check failed)",
    "interrupted": "INTERRUPTED",
}


def headline(doc: dict[str, Any]) -> str:
    """The outcome in words, for the report's title and the command's summary line."""
    text = HEADLINES[doc["outcome"]]
    if doc["outcome"] == "interrupted":
        text += f" by {doc['interrupted']} (what ran until then)"
    return text


def implementation_record(adapter: Adapter) -> dict[str, Any]:
    """What the report says of the implementation: its ref, name, outputs, contract, claims."""
    return {
        "impl": adapter.ref or adapter.name,
        "name": adapter.name,
        "description": adapter.description,
        "outputs": list(adapter.outputs),
        "contract": asdict(adapter.contract),
        "capabilities": asdict(adapter.capabilities),
    }


def _timing_row(backend: str, kind: str, row: dict[str, Any]) -> dict[str, Any]:
    clock = covered_seconds(row["spans"])
    return {
        "backend": backend,
        "kind": kind,
        "examples": row["examples"],
        "wall_s": round(row["wall_s"], 3),
        "clock_s": round(clock, 3),
        "examples_per_s": round(row["examples"] / clock, 3) if clock > 0 else None,
        "compiles": row["compiles"],
        "seconds": {name: round(row["seconds"].get(name, 0.0), 3) for name in STAGES},
    }


def covered_seconds(spans: list[tuple[float, float]]) -> float:
    """Seconds of the clock inside at least one ``(start, end)`` span: overlapping examples of
    concurrent searches count once, back-to-back examples of one search add up."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def write(
    tally: Tally, meta: dict[str, Any], out_dir: Path | str
) -> tuple[dict[str, Any], dict[str, Path | None]]:
    """Write ``report.json``, ``report.md`` and ``ratios.png`` (when matplotlib is installed) into
    ``out_dir``; returns the report document and the paths (``png`` None without a plot)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png: Path | None = out / PLOT_FILE
    try:
        from verify.results.ratio_plot import plot_ratios

        plot_ratios({key: cell.ratios for key, cell in tally.cells.items()}, png, meta["title"])
    except ImportError:  # matplotlib is an optional extra (lce[verify]); the tables still tell
        png = None
    document = to_json(tally, {**meta, "plot": PLOT_FILE if png else None})
    paths = {"json": out / "report.json", "markdown": out / "report.md", "png": png}
    _atomic_text(paths["json"], json.dumps(document, indent=1, sort_keys=True) + "\n")
    _atomic_text(paths["markdown"], markdown(document))
    return document, paths


def _seed_note(seed: int | None) -> str:
    return "" if seed is None else f"; seed {seed} (`--seed` draws the same examples)"


def markdown(doc: dict[str, Any]) -> str:
    """The readable report: verdict, timing, examples, worst ratios, failures, errors, and what
    was not tested."""
    verdict = headline(doc)
    rate = doc["examples_per_s"]
    env = doc.get("environment", {})
    versions = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if v)
    lines = [
        f"# {doc['title']}: {verdict}",
        "",
        f"- {doc['examples']} examples in {doc['wall_s']:.0f} s ({rate} examples/s), "
        f"budget {doc['budget_s']:.0f} s{' (exhausted)' if doc.get('budget_exhausted') else ''}"
        + _seed_note(doc.get("seed")),
        f"- {len(doc['failures'])} failure(s), {len(doc['errors'])} infrastructure error(s)",
        f"- device: {env.get('device', '?')}; {versions}",
        "",
        "## Where the time went, per backend (seconds; ms per example)",
        "",
        "examples/s: examples over the clock seconds in which at least one of them ran; example s:"
        " their wall times added up, which the stages split (over concurrent searches, more than"
        " the clock).",
        "",
        *_timing_table(doc.get("timing", [])),
        "",
        "## Examples (failing examples) per property and backend/TP",
        "",
        *_count_table(doc["counts"], "property"),
        "",
        "## Examples per dtype and backend/TP",
        "",
        *_count_table(doc["examples_by_dtype"], "dtype"),
        "",
        "## Examples per extent and backend/TP (sizes past real kernels' tile boundaries)",
        "",
        *_count_table(doc.get("examples_by_extent", []), "extent"),
        "",
        "## Worst measured/allowed per output and dtype (all backends; <= 1 passes)",
        "",
        *_worst_table(doc["worst"]),
        "",
        f"![measured/allowed ratios]({doc['plot']})"
        if doc.get("plot")
        else "(no plot: matplotlib is not installed)",
        "",
        *_failure_lines(doc["failures"]),
        *_error_lines(doc["errors"]),
        *coverage_report.markdown(doc.get("coverage", [])),
        *_untested_lines(doc.get("not_tested", [])),
    ]
    return "\n".join(lines) + "\n"


def _count_table(counts: list[dict[str, Any]], row_key: str) -> list[str]:
    columns = sorted({(c["backend"], c["tp"]) for c in counts})
    rows = sorted({c[row_key] for c in counts})
    if not rows:
        return ["(no examples ran)"]
    cells: dict[tuple[str, tuple[str, int]], list[int]] = defaultdict(lambda: [0, 0])
    for c in counts:
        cell = cells[(c[row_key], (c["backend"], c["tp"]))]
        cell[0] += c["examples"]
        cell[1] += c["failures"]
    header = [row_key, *(f"{b} TP={t}" for b, t in columns)]
    lines = [_row(header), _row(["---"] * len(header))]
    for row in rows:
        values = []
        for col in columns:
            n, f = cells.get((row, col), (0, 0))
            values.append(f"{n} (**{f}**)" if f else (str(n) if n else "-"))
        lines.append(_row([row, *values]))
    return lines


def _timing_table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["(no examples ran)"]
    header = ["backend (examples)", "examples/s", "clock s", "example s", "compiles", *STAGES]
    lines = [_row(header), _row(["---"] * len(header))]
    for r in rows:
        per_ms = 1000.0 / max(1, r["examples"])
        stages = [f"{s:.1f} ({s * per_ms:.0f})" for s in (r["seconds"][n] for n in STAGES)]
        name = f"{r['backend']} {r['kind']} ({r['examples']})"
        times = [str(r["examples_per_s"]), f"{r['clock_s']:.1f}", f"{r['wall_s']:.1f}"]
        lines.append(_row([name, *times, str(r["compiles"]), *stages]))
    return lines


def _worst_table(worst: list[dict[str, Any]]) -> list[str]:
    dtypes = sorted({w["dtype"] for w in worst})
    outputs = sorted({w["output"] for w in worst})
    if not outputs:
        return ["(no verdicts)"]
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for w in worst:
        key, ratio = (w["output"], w["dtype"]), order(float(w.get("ratio", 0.0)))
        if key not in best or ratio > order(float(best[key].get("ratio", 0.0))):
            best[key] = w
    lines = [_row(["output", *dtypes]), _row(["---"] * (len(dtypes) + 1))]
    for out in outputs:
        values = [_worst_text(best[(out, d)]) if (out, d) in best else "-" for d in dtypes]
        lines.append(_row([out, *values]))
    return lines


def _worst_text(worst: dict[str, Any]) -> str:
    return _ratio_text(float(worst.get("ratio", 0.0)))


def _failure_lines(failures: list[dict[str, Any]]) -> list[str]:
    if not failures:
        return ["## Failures", "", "None.", ""]
    lines = [
        "## Failures",
        "",
        _row(
            ["property", "output", "tier", "backend", "TP", "dtype", "ratio", "shrunk", "artifact"]
        ),
        _row(["---"] * 9),
    ]
    for f in failures:
        lines.append(
            _row(
                [
                    _short_properties(f["property"]),
                    f.get("output", "?"),
                    f.get("tier", "?"),
                    f["backend"],
                    str(f["tp"]),
                    f["dtype"],
                    _ratio_text(float(f.get("ratio", math.inf))),
                    "yes" if f.get("shrunk") else "no",
                    f"`{f['artifact']}`",
                ]
            )
        )
    return [*lines, ""]


def _short_properties(names: str) -> str:
    """``a,b,c`` as ``a (+2)``: the table stays narrow; the JSON and the artifact list them all."""
    first, *rest = names.split(",")
    return f"{first} (+{len(rest)})" if rest else first


def _error_lines(errors: list[dict[str, Any]]) -> list[str]:
    if not errors:
        return []
    return ["## Infrastructure errors", "", *(f"- {e['where']}: {e['message']}" for e in errors)]


def _untested_lines(untested: list[dict[str, Any]]) -> list[str]:
    if not untested:
        return []
    return ["", "## Not tested", "", *(f"- {u['what']}: {u['reason']}" for u in untested)]


def _ratio_text(ratio: float) -> str:
    if math.isnan(ratio) or ratio > 1.0:
        return f"**{ratio:.3g}**"
    return "0" if ratio == 0 else f"{ratio:.3g}"


def order(ratio: float) -> float:
    """NaN sorts as the worst ratio (a NaN measure is a failure, never a pass)."""
    return math.inf if math.isnan(ratio) else ratio


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
