"""The harness against `benchmarks/bug_zoo.py`: one ci campaign per third-party kernel, a table of
which bug each campaign found (property, output, tier, the shrunk case's sizes) and how soon.

    python benchmarks/zoo_campaigns.py --budget-s 90 --jobs 1 --json OUT/zoo.json

Each campaign is `python -m verify run --impl bug_zoo:NAME --profile ci --tp 1,2` in a process of
its own (``--jobs`` side by side: give each two cores). A kernel counts as caught when its
campaign has a failure whose case passes on the kernel's clean twin (`bug_zoo.ZOO`), replayed;
"others" counts the failures the twin fails too (findings about the code the bug sits in).
"at example" is the search's count when that failure was found (its artifact's ``examples``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import bug_zoo

HERE = Path(__file__).resolve().parent


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }


def _twin_passes(artifact: str, twin: str) -> bool:
    """The failure's case passes on the kernel's clean twin: the failure is the kernel's bug."""
    cmd = [sys.executable, "-m", "verify", "replay", "--times", "1", "--impl", f"bug_zoo:{twin}"]
    proc = subprocess.run([*cmd, artifact], env=_env(), capture_output=True, check=False)
    return proc.returncode == 0


def run_one(name: str, budget_s: float, out: Path, seed: int | None) -> dict:
    """One campaign of ``bug_zoo:name``; its row of the table."""
    target = out / name
    cmd = [
        sys.executable, "-m", "verify", "run", "--impl", f"bug_zoo:{name}", "--profile", "ci",
        "--tp", "1,2", "--budget-s", str(budget_s), "--out", str(target),
    ]  # fmt: skip
    if seed is not None:
        cmd += ["--seed", str(seed)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    report_path = target / "report.json"
    if not report_path.exists():
        return {"kernel": name, "caught": False, "error": proc.stderr[-400:], "wall_s": wall}
    report = json.loads(report_path.read_text())
    failures = [f for f in report["failures"] if not f.get("harness")]
    own = [f for f in failures if _twin_passes(f["artifact"], bug_zoo.ZOO[name])]
    row = {
        "kernel": name, "caught": bool(own), "exit": proc.returncode,
        "examples": report["examples"], "failures": len(failures), "the_bug": len(own),
        "harness_errors": sum(1 for f in report["failures"] if f.get("harness")),
        "wall_s": round(wall, 1),
    }  # fmt: skip
    if own:
        first = json.loads(Path(own[0]["artifact"]).read_text())
        spec = first["spec"]
        row |= {
            "first": f"{own[0]['property']} {own[0].get('output')} [{own[0].get('tier')}]",
            "at_example": first.get("examples"),
            "shrunk": {k: spec.get(k) for k in ("tokens", "batch", "hidden_size", "vocab", "tp")},
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=90.0, help="each campaign's budget")
    parser.add_argument("--jobs", type=int, default=1, help="campaigns side by side")
    parser.add_argument("--only", default="", help="comma-separated kernel names (all)")
    parser.add_argument("--seed", type=int, default=None, help="Hypothesis seed (the profile's)")
    parser.add_argument("--out", type=Path, default=Path("results/zoo"))
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(bug_zoo.ZOO)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(lambda n: run_one(n, args.budget_s, args.out, args.seed), names))
    print("| kernel | caught | its finding | at example | shrunk (T, B, H, V, tp) | others | s |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        sizes = tuple(row.get("shrunk", {}).values()) or "-"
        others = row.get("failures", 0) - row.get("the_bug", 0)
        caught = "yes" if row["caught"] else f"**no** ({row.get('examples', '?')} examples)"
        print(
            f"| {row['kernel']} | {caught} | {row.get('first', row.get('error', '-'))} "
            f"| {row.get('at_example', '-')} | {sizes} | {others} | {row['wall_s']} |"
        )
    caught = sum(r["caught"] for r in rows)
    print(f"\n{caught} of {len(rows)} caught")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
