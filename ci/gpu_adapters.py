"""Run the property engine against third-party implementations through their adapters.

    python ci/gpu_adapters.py --out DIR [--impl liger --impl cce ...] [--profile nightly]
                              [--minutes 2] [--total-minutes 5]

Defaults: ``liger``, ``cce``, ``cce-exact``, ``verl`` and the issue-33 benchmark's peers
(``cce-compile``, ``liger-cute``, ``liger-cute-flce``, ``quack``) on a CUDA machine (verl:
installed with ``pip install --no-deps verl`` or named by ``VERL_PATH``; with two GPUs also at
TP = 2 over NCCL);
``torch`` and ``lce-torch`` on a CPU machine (so the script itself is known to work anywhere).
``--minutes`` is each implementation's time budget; ``--total-minutes`` bounds the whole run:
each implementation then gets at most its part of the time left less `STARTUP_S` (peers
JIT-compile their kernels for every new shape; the search stops at its budget, but the first
example's compile comes on top). When the time left cannot give every remaining implementation
`STARTUP_S` + `MIN_SEARCH_S`, the last ones are reported as not run. Each implementation is one
campaign (`verify.running.campaign`, the same as ``lce-verify run --impl``): its report and failure
artifacts go to ``DIR/<impl>/`` (``lce-verify replay`` re-runs an artifact); ``DIR/adapters.json``
and ``DIR/adapters.md`` gather them. An implementation whose package or device is missing is
reported as skipped. Exit code 0 unless the script broke.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verify.adapters import Adapter, AdapterError, resolve
from verify.results.artifacts import device_description, versions
from verify.running.campaign import run_campaign
from verify.running.config import CampaignConfig

GPU_DEFAULT = ("liger", "cce", "cce-exact", "verl", "cce-compile", "liger-cute", "liger-cute-flce",
               "quack")  # fmt: skip
# Measured since the search stops inside its batch: Liger took 64 s on a 50 s budget on an H100
# (kernel compiles for the first shapes, and the process start).
STARTUP_S = 25.0
MIN_SEARCH_S = 6.0
CPU_DEFAULT = ("torch", "lce-torch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the findings")
    parser.add_argument(
        "--impl", action="append", help="built-in name or module:function (repeatable)"
    )
    parser.add_argument("--profile", default="nightly", choices=("ci", "nightly", "dev"))
    parser.add_argument("--minutes", type=float, default=2.0, help="time budget per implementation")
    parser.add_argument(
        "--total-minutes", type=float, default=None, help="time budget of the whole run (none)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the campaigns' seed")
    parser.add_argument(
        "--max-examples", type=int, default=None, help="examples per search (the profile's)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    impls = args.impl or (GPU_DEFAULT if torch.cuda.is_available() else CPU_DEFAULT)
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    summary = {
        "profile": args.profile, "minutes": args.minutes, "versions": versions(),
        "device": device_description(device), "implementations": [],
    }  # fmt: skip
    sections = [
        "# Third-party implementations under the property engine",
        "",
        f"Command: `python ci/gpu_adapters.py --profile {args.profile} --minutes {args.minutes}"
        f" --impl {' --impl '.join(impls)}`; device {summary['device']}; "
        f"versions {json.dumps(summary['versions'])}",
        "",
    ]
    deadline = None if args.total_minutes is None else time.monotonic() + 60 * args.total_minutes
    for index, ref in enumerate(impls):
        began = time.monotonic()
        minutes = args.minutes
        if deadline is not None:
            left = deadline - began
            # As many of the implementations still to run as the time left can start, each
            # with an equal part: the later ones are left out first.
            runnable = min(len(impls) - index, int(left // (STARTUP_S + MIN_SEARCH_S)))
            search_s = left / max(runnable, 1) - STARTUP_S
            if search_s < MIN_SEARCH_S:
                reason = f"not run: {left:.0f} s of --total-minutes left"
                summary["implementations"].append({"impl": ref, "skipped": reason})
                sections.append(f"## {ref}: skipped\n\n{reason}\n")
                print(f"{ref}: skipped ({reason})", flush=True)
                continue
            minutes = min(minutes, search_s / 60)
        try:
            adapter = resolve(ref)
        except AdapterError as exc:
            summary["implementations"].append({"impl": ref, "skipped": str(exc)})
            sections.append(f"## {ref}: skipped\n\n{exc}\n")
            print(f"{ref}: skipped ({exc})", flush=True)
            continue
        config = CampaignConfig(
            impl=ref, profile=args.profile, budget_s=60 * minutes, tp_sizes=_tp_sizes(adapter),
            device=device, seed=args.seed, max_examples=args.max_examples,
            out_dir=args.out / _slug(ref),
        )  # fmt: skip
        doc = run_campaign(config).report
        summary["implementations"].append(_summary(ref, doc))
        sections.append((config.out_dir / "report.md").read_text().replace("# ", "## ", 1))
        print(f"{ref}: {doc['outcome']} in {time.monotonic() - began:.0f} s", flush=True)
        _write(args.out, summary, sections)  # after each one: a killed run keeps what it found
    _write(args.out, summary, sections)
    print(f"wrote {args.out / 'adapters.md'} and {args.out / 'adapters.json'}")
    return 0


def _tp_sizes(adapter: Adapter) -> tuple[int, ...]:
    """TP 1, and 2 over NCCL for a CUDA adapter claiming tensor parallelism when two GPUs are
    visible."""
    parallel = adapter.capabilities.tensor_parallel and adapter.device == "cuda"
    return (1, 2) if parallel and torch.cuda.device_count() >= 2 else (1,)


def _slug(ref: str) -> str:
    return ref.replace(":", "-").replace("/", "-")


def _summary(ref: str, doc: dict) -> dict:
    """One implementation's line of adapters.json: outcome, examples per property, failures."""
    examples: dict[str, int] = {}
    for row in doc["counts"]:
        examples[row["property"]] = examples.get(row["property"], 0) + row["examples"]
    return {
        "impl": ref, "outcome": doc["outcome"], "report": doc["out_dir"],
        "properties": [{"property": name, "examples": examples.get(name, 0)}
                       for name in doc["properties"]],
        "failures": doc["failures"], "errors": doc["errors"], "not_tested": doc["not_tested"],
    }  # fmt: skip


def _write(out: Path, summary: dict, sections: list[str]) -> None:
    (out / "adapters.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "adapters.md").write_text("\n".join(sections))


if __name__ == "__main__":
    sys.exit(main())
