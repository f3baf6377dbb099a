"""N seeded ``ci`` campaigns side by side, and one table of them.

    python ci/seeded_campaigns.py --seeds 1-20 --jobs 16 --out DIR [ARGS for verify run]

Each seed runs ``python -m verify run --profile ci --device cpu --seed S --out DIR/seed-S/report``
(both backends, the Triton one in its interpreter, TP 1/2/4, as the main job does), with the
arguments this script does not know passed on (e.g. ``--budget-s 120 --backends torch``).
Campaigns share no scratch path: each has its own report folder, temporary directory (the worker
pools' FileStores, the fork server's socket), Triton home and cache, Inductor cache and
Hypothesis storage directory; and no core: ``--jobs`` campaigns at a time split the cores this
process may use, and each campaign's worker pools size their threads to its share. Prints a
Markdown table (seed, verdict, examples, failures, examples and pairs reached per slice, wall
seconds) and writes it as ``DIR/summary.md``, the rows as ``DIR/summary.json``; exits 1 if any
campaign did not pass.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# verify's exit codes (docs/exit-codes.md) as a verdict
VERDICTS = {0: "passed", 1: "failed", 2: "usage error", 3: "infrastructure", 4: "harness error"}


def seeds_of(text: str) -> list[int]:
    """``"1-20"``, ``"3"``, ``"1,4,7-9"`` -> the seeds, in order, each once."""
    seeds: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            span = range(int(first), int(last or first) + 1)
        except ValueError:
            raise SystemExit(
                f"--seeds: {part!r} is no seed or range (e.g. 1-20 or 1,4,7-9)"
            ) from None
        seeds += [s for s in span if s not in seeds]
    if not seeds:
        raise SystemExit("--seeds: no seed given (e.g. 1-20)")
    return seeds


def core_sets(jobs: int) -> list[set[int]]:
    """``jobs`` disjoint sets of this process's CPU cores (round robin), or, with fewer cores
    than jobs, one core each, shared in turn."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cores:
        return [set() for _ in range(jobs)]
    if len(cores) < jobs:
        return [{cores[i % len(cores)]} for i in range(jobs)]
    return [set(cores[i::jobs]) for i in range(jobs)]


def command(seed: int, out: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "verify", "run", "--profile", "ci", "--device", "cpu",
        "--seed", str(seed), "--out", str(out), *extra,
    ]  # fmt: skip


def environment(folder: Path, cores: set[int]) -> dict[str, str]:
    """The campaign's own scratch paths and thread count."""
    names = ("tmp", "triton", "triton-cache", "inductor-cache", "hypothesis")
    scratch = {name: folder / name for name in names}
    for path in scratch.values():
        path.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["TMPDIR"] = str(scratch["tmp"])
    env["TRITON_HOME"] = str(scratch["triton"])
    env["TRITON_CACHE_DIR"] = str(scratch["triton-cache"])
    env["TORCHINDUCTOR_CACHE_DIR"] = str(scratch["inductor-cache"])
    env["HYPOTHESIS_STORAGE_DIRECTORY"] = str(scratch["hypothesis"])
    if cores:
        env["OMP_NUM_THREADS"] = str(len(cores))
    return env


def run_one(seed: int, out: Path, extra: list[str], free: queue.Queue) -> dict[str, Any]:
    """One campaign on a core set taken from ``free`` (given back after), its log in
    ``out/seed-S/campaign.log``; its summary row."""
    cores = free.get()
    try:
        return _campaign(seed, out, extra, cores)
    finally:
        free.put(cores)


def _campaign(seed: int, out: Path, extra: list[str], cores: set[int]) -> dict[str, Any]:
    folder = out / f"seed-{seed}"
    report = folder / "report"
    folder.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with open(folder / "campaign.log", "w") as log:
        code = subprocess.call(
            command(seed, report, extra), cwd=ROOT, env=environment(folder, cores),
            stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
        )  # fmt: skip
    return summary_row(seed, code, report / "report.json", time.monotonic() - began)


def summary_row(seed: int, code: int, path: Path, wall_s: float) -> dict[str, Any]:
    """What the table shows of one campaign, from its report.json (when it wrote one)."""
    row: dict[str, Any] = {"seed": seed, "exit": code, "wall_s": round(wall_s, 1)}
    row["verdict"] = VERDICTS.get(code, f"exit {code}")
    if not path.exists():
        return row | {"examples": None, "failures": None, "slices": []}
    document = json.loads(path.read_text())
    row["examples"], row["failures"] = document["examples"], len(document["failures"])
    row["report"] = str(path)
    reached = {(c["backend"], c["tp"]): c for c in document.get("coverage") or []}
    row["slices"] = []
    for item in document["slices"]:
        entry = reached.get((item["backend"], item["tp"]), {"properties": []})
        got = sum(p["reached"] for p in entry["properties"])
        wanted = sum(p["supported"] for p in entry["properties"])
        row["slices"].append({
            "slice": f"{item['backend']} TP={item['tp']}", "status": item["status"],
            "examples": item["examples"], "pairs_reached": got, "pairs_supported": wanted,
        })  # fmt: skip
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table: one line per seed, one column per slice (examples, pairs reached)."""
    names = list(dict.fromkeys(s["slice"] for row in rows for s in row["slices"]))
    head = ["seed", "verdict", "examples", "failures", *names, "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        by_name = {s["slice"]: s for s in row["slices"]}
        cells = [str(row["seed"]), row["verdict"], str(row["examples"]), str(row["failures"])]
        for name in names:
            cells.append(_slice_cell(by_name.get(name)))
        lines.append("| " + " | ".join([*cells, f"{row['wall_s']:.0f}"]) + " |")
    passed = sum(row["verdict"] == "passed" for row in rows)
    return "\n".join([*lines, "", f"{passed}/{len(rows)} passed"])


def _slice_cell(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "-"
    if not entry["pairs_supported"]:  # the slice never started: no plan was made
        return f"{entry['examples']} ex ({entry['status']})"
    share = entry["pairs_reached"] / entry["pairs_supported"]
    return f"{entry['examples']} ex, {share:.0%} pairs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", required=True, help="e.g. 1-20 or 1,4,7-9")
    parser.add_argument("--jobs", type=int, default=1, help="campaigns at a time (1)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "seeded")
    args, extra = parser.parse_known_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    for fixed in ("--profile", "--device", "--seed", "--out"):
        if fixed in extra:
            parser.error(f"{fixed} is set per campaign here; leave it out")
    seeds, out = seeds_of(args.seeds), args.out.resolve()
    free: queue.Queue = queue.Queue()
    for cores in core_sets(args.jobs):
        free.put(cores)
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_one, seed, out, extra, free) for seed in seeds]
        rows = [future.result() for future in futures]
    table = markdown(rows)
    print(table)
    (out / "summary.md").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps({"argv": extra, "campaigns": rows}, indent=1))
    return 0 if all(row["verdict"] == "passed" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
