"""Run the ``ci`` profile N times with different seeds and count false failures (issue 4's
"zero false failures across 20 consecutive runs"): ``python -m verify.running.soak --runs 20``."""

from __future__ import annotations

import argparse
import json
import time

from verify.execution.runner import Runner
from verify.running.engine import run_property
from verify.running.selftest import selftest_specs

SOAK_PROPERTIES = (
    "differential", "contract", "chunk_invariance", "vocab_permutation", "shift_invariance",
    "entropy_targets", "upstream_linearity", "ignored_rows", "tied_untied", "temperature",
    "reduction", "determinism", "torch_peer",
)  # fmt: skip


def soak(runs: int, max_examples: int | None = None) -> list[dict]:
    """One row per seed: examples, failing verdict lines, seconds."""
    rows = []
    for seed in range(runs):
        result = run_property(
            SOAK_PROPERTIES, strategy=selftest_specs((1,)), profile="ci", runner=Runner(),
            max_examples=max_examples, seed=seed,
        )  # fmt: skip
        result.raise_errors()
        rows.append({
            "seed": seed, "examples": result.examples,
            "failures": [v.line() for v in result.failure], "seconds": round(result.seconds, 1),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--max-examples", type=int, default=None)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    rows = soak(args.runs, args.max_examples)
    failed = [r["seed"] for r in rows if r["failures"]]
    print(f"{len(rows)} runs in {time.perf_counter() - began:.0f} s; failing seeds: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
