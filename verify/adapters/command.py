"""The ``--impl`` side of the CLI: `lce-verify run --impl X` and `lce-verify replay --impl X`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from verify.adapters.check import check_impl
from verify.adapters.impl_replay import replay_impl
from verify.adapters.impl_report import to_json, to_markdown
from verify.cli import EXIT_FAIL, EXIT_HARNESS, EXIT_PASS
from verify.distributed.seam import open_pool
from verify.execution.selection import resolve


def run_impl(args: argparse.Namespace) -> int:
    """Search the profile's properties on ``args.impl`` within ``--budget-s``; write
    ``impl-report.md`` / ``impl-report.json`` into ``--out`` and artifacts into ``--failures``."""
    adapter = resolve(args.impl)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    with open_pool(max(args.tp), args.device) as pool:
        report = check_impl(
            adapter,
            profile=args.profile,
            properties=args.properties or None,
            max_examples=args.max_examples,
            minutes=args.budget_s / 60.0,
            pool=pool,
            failures_dir=args.failures or out / "failures",
            seed=args.seed or 0,
        )
    (out / "impl-report.md").write_text(to_markdown(report))
    (out / "impl-report.json").write_text(json.dumps(to_json(report), indent=1) + "\n")
    print(f"{adapter.name}: {'PASSED' if report.passed else 'FAILED'}")
    for line in report.failure_lines():
        print(f"  {line}")
    print(f"report: {out / 'impl-report.md'} (JSON {out / 'impl-report.json'})")
    if report.implementation_failed:
        return EXIT_FAIL  # a verdict on the implementation outranks a harness error
    return EXIT_HARNESS if report.harness_errors else EXIT_PASS


def replay_with_impl(files: list[Path], impl: str | None, times: int, device: str) -> int:
    """Replay each artifact through ``impl`` (default: the one recorded in the artifact)."""
    from verify.results import artifacts
    from verify.results.replay import summary_lines

    loaded = [artifacts.load(path) for path in files]
    ok = True
    with open_pool(max(a.spec.tp for a in loaded), device) as pool:
        for artifact in loaded:
            result = replay_impl(artifact, impl=impl, pool=pool, times=times)
            ok &= result.passed and result.identical
            for line in summary_lines(result, None):
                print(line)
    return EXIT_PASS if ok else EXIT_FAIL
