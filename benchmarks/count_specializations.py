"""Offline count of the Triton kernels' compiled specializations a GPU campaign's Triton slice
meets: how many distinct compiles its drawn specs need (docs/NIGHTLY.md).

Draws ``--examples`` specs from the slice's strategy (`campaign_specs`, triton, TP=1) as a
search's generate phase does and runs each spec's lce call and gradients on the CPU under
`verify.running.specializations.recording`: no kernel runs, each launch's compile key (Triton's
own ``native_specialize_impl`` on its arguments, under the GPU tile config) is recorded. Prints
the distinct keys per kernel after 1/4, 1/2, 3/4 and all of the examples.

    python benchmarks/count_specializations.py [--examples 1100] [--seed 1] [--json out.json]

Run without ``TRITON_INTERPRET`` (the count needs the compiled kernels' `JITFunction`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=1100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the count needs the compiled kernels' JITFunction")
    from verify.running import specializations

    specs = specializations.drawn_specs(args.examples, args.seed)
    marks = {len(specs) * q // 4 for q in (1, 2, 3, 4)}
    rows = []
    with specializations.recording() as seen:
        for done, spec in enumerate(specs, 1):
            specializations.launch(spec)
            if done in marks:
                row = {"examples": done, "total": len(seen)}
                row.update({k: sum(name == k for name, _ in seen) for k in specializations.KERNELS})
                rows.append(row)
    print(" | ".join(rows[0]))
    for row in rows:
        print(" | ".join(str(v) for v in row.values()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
