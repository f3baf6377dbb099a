"""GPU nightly: every verification and benchmark step on a CUDA machine, into one directory.

    python ci/nightly_gpu.py --out DIR [--minutes 9]

Steps, each bounded by its share of ``--minutes`` (a step past its share is killed and fails):
environment, the compiled kernel's stage tests, the ``nightly``
campaign on both backends at every TP degree the GPUs allow (NCCL),
the regression corpus and the mutation self-test on the Triton backend, the kernel benchmark, the
megatron-core check and the peer adapters (Liger, CCE). Writes ``DIR/summary.md``,
``DIR/summary.json``, ``DIR/nightly.log`` and each step's own files; exits 1 if any step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 30


@dataclass
class Step:
    name: str
    share: float  # of the whole budget
    argv: list[str]
    status: str = "not run"
    seconds: float = 0.0
    tail: str = ""


def tp_degrees(gpus: int) -> list[int]:
    return [tp for tp in (1, 2, 4) if tp <= gpus]


def plan(out: Path, budget_s: float, gpus: int) -> list[Step]:
    py = sys.executable
    tps = ",".join(map(str, tp_degrees(gpus)))
    verify = [py, "-m", "verify"]
    campaign_s = int(0.35 * budget_s * 0.9)  # the campaign stops itself inside its share
    return [
        Step("environment", 0.02, [py, "-c", ENV_PROBE]),
        Step("kernel_tests", 0.05, [py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "tests/test_triton_stages.py"]),
        Step("campaign", 0.35, [*verify, "run", "--profile", "nightly", "--device", "cuda",
             "--backends", "triton,torch", "--tp", tps, "--budget-s", str(campaign_s),
             "--out", str(out / "campaign")]),
        Step("corpus", 0.06, [*verify, "corpus", "--backend", "triton", "--device", "cuda"]),
        Step("mutants", 0.12, [*verify, "mutants", "--backend", "triton", "--device", "cuda",
             "--tp", tps, "--json", str(out / "mutants.json")]),
        Step("kernel_benchmark", 0.22, [py, "benchmarks/kernel_gpu.py", "--no-sweep",
             "--json", str(out / "kernel_gpu.json")]),
        Step("megatron", 0.06, [py, "ci/gpu_megatron_check.py", "--nprocs", str(min(gpus, 2)),
             "--backend", "triton", "--json", str(out / "megatron.json")]),
        Step("adapters", 0.12, [py, "ci/gpu_adapters.py", "--out", str(out / "adapters"),
             "--minutes", f"{0.12 * budget_s / 60 / 3 * 0.8:.2f}"]),
    ]  # fmt: skip


ENV_PROBE = """
import platform, torch, triton
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__)
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i}", torch.cuda.get_device_name(i))
"""


def run_step(step: Step, budget_s: float, log) -> None:
    limit = max(30.0, step.share * budget_s)
    began = time.monotonic()
    log.write(f"\n===== {step.name} (limit {limit:.0f} s): {' '.join(step.argv)}\n")
    log.flush()
    try:
        done = subprocess.run(
            step.argv, cwd=ROOT, timeout=limit, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        output, step.status = done.stdout, "passed" if done.returncode == 0 else "failed"
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout if isinstance(expired.stdout, str) else ""
        step.status = f"failed: timed out after {limit:.0f} s"
    step.seconds = time.monotonic() - began
    log.write(output)
    log.write(f"\n----- {step.name}: {step.status} in {step.seconds:.1f} s\n")
    log.flush()
    step.tail = "\n".join(output.rstrip().splitlines()[-TAIL_LINES:])


def summary_markdown(steps: list[Step], gpus: int, budget_s: float) -> str:
    lines = [
        f"# GPU nightly, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"{gpus} GPU(s), budget {budget_s / 60:.1f} min, total "
        f"{sum(s.seconds for s in steps) / 60:.1f} min.",
        "",
        "| step | status | seconds |",
        "|---|---|---|",
        *(f"| {s.name} | {s.status} | {s.seconds:.1f} |" for s in steps),
    ]
    for step in steps:
        lines += ["", f"## {step.name}", "", "```", step.tail, "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "nightly")
    parser.add_argument("--minutes", type=float, default=9.0, help="budget for all steps")
    parser.add_argument("--skip", default="", help="comma-separated steps to leave out")
    args = parser.parse_args(argv)
    import torch  # after argparse, so --help works without torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        parser.error("no CUDA GPU is visible: this script is the GPU nightly (CPU: ci/campaign)")
    args.out.mkdir(parents=True, exist_ok=True)
    budget_s = args.minutes * 60
    skipped = set(filter(None, args.skip.split(",")))
    steps = [s for s in plan(args.out, budget_s, gpus) if s.name not in skipped]
    with (args.out / "nightly.log").open("w") as log:
        for step in steps:
            run_step(step, budget_s, log)
    (args.out / "summary.md").write_text(summary_markdown(steps, gpus, budget_s))
    record = {"gpus": gpus, "budget_s": budget_s, "steps": [asdict(s) for s in steps]}
    (args.out / "summary.json").write_text(json.dumps(record, indent=2))
    print((args.out / "summary.md").read_text())
    return 0 if all(s.status == "passed" for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
