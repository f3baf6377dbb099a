"""Run the property engine against third-party implementations through their adapters.

    python ci/gpu_adapters.py --out DIR [--impl liger --impl cce ...] [--profile nightly]
                              [--minutes 2]

Defaults: ``liger``, ``cce`` and ``cce-exact`` on a CUDA machine; ``torch`` and ``lce-torch`` on
a CPU machine (so the script itself is known to work anywhere). ``--minutes`` is each
implementation's time budget. Writes ``DIR/adapters.json``, ``DIR/adapters.md`` and failure
artifacts under ``DIR/failures`` (replay: ``verify.adapters.replay_impl``). An implementation
whose package or device is missing is reported as skipped. Exit code 0 unless the script broke.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verify.adapters import AdapterError, check_impl, resolve
from verify.adapters.report import to_json, to_markdown
from verify.artifacts import device_description, versions

GPU_DEFAULT = ("liger", "cce", "cce-exact")
CPU_DEFAULT = ("torch", "lce-torch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the findings")
    parser.add_argument(
        "--impl", action="append", help="built-in name or module:function (repeatable)"
    )
    parser.add_argument("--profile", default="nightly", choices=("ci", "nightly", "dev"))
    parser.add_argument("--minutes", type=float, default=2.0, help="time budget per implementation")
    parser.add_argument("--seed", type=int, default=0, help="first seed of the seeded batches")
    parser.add_argument(
        "--max-examples", type=int, default=None, help="examples per seeded batch (default 20)"
    )
    parser.add_argument(
        "--failures", type=Path, default=None, help="artifact directory (default OUT/failures)"
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
    for ref in impls:
        began = time.monotonic()
        try:
            resolve(ref)
        except AdapterError as exc:
            summary["implementations"].append({"impl": ref, "skipped": str(exc)})
            sections.append(f"## {ref}: skipped\n\n{exc}\n")
            print(f"{ref}: skipped ({exc})", flush=True)
            continue
        report = check_impl(
            ref, profile=args.profile, minutes=args.minutes, seed=args.seed,
            max_examples=args.max_examples, failures_dir=args.failures or args.out / "failures",
        )  # fmt: skip
        summary["implementations"].append(to_json(report))
        sections.append(to_markdown(report))
        state = "passed" if report.passed else "FAILED"
        print(f"{ref}: {state} in {time.monotonic() - began:.0f} s", flush=True)
        _write(args.out, summary, sections)  # after each one: a killed run keeps what it found
    _write(args.out, summary, sections)
    print(f"wrote {args.out / 'adapters.md'} and {args.out / 'adapters.json'}")
    return 0


def _write(out: Path, summary: dict, sections: list[str]) -> None:
    (out / "adapters.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "adapters.md").write_text("\n".join(sections))


if __name__ == "__main__":
    sys.exit(main())
