"""Worker-pool benchmark: start time, lce examples per second at each TP degree, pool overhead.

Each example is a new seed of a `CaseSpec` run by the harness's case job
(`verify.execution.execute.CASE_JOB`: build the global problem, take the shard, lce's token outputs
and its loss, forward + backward). Per example: ``compute`` = the lce calls and their gradients
(slowest rank), ``job`` = the whole job function (adds building tensors and checking the inputs),
``wall`` = the driver's `pool.run`. Pool overhead = (wall - job) / compute.

    PYTHONPATH=. python benchmarks/pool_bench.py [--small 40 --medium 8] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from verify.cases.spec import CaseSpec
from verify.distributed import WorkerPool
from verify.execution.execute import CASE_JOB, case_payload

SIZES = {"small": (64, 64, 512), "medium": (512, 256, 8192)}  # tokens, hidden, vocab


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def idle_cpu_percent(pids: list[int], seconds: float) -> float:
    """CPU used by idle workers over ``seconds`` (percent of one core, all workers together)."""

    def ticks() -> int:
        total = 0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        return total

    before = ticks()
    time.sleep(seconds)
    return 100.0 * (ticks() - before) / os.sysconf("SC_CLK_TCK") / seconds


def case(size: str, tp: int, seed: int) -> dict:
    """The case job's payload for one example: fp32, torch backend, random ignored tokens."""
    tokens, hidden, vocab = SIZES[size]
    spec = CaseSpec(
        tokens=tokens, hidden_size=hidden, vocab=vocab, tp=tp, scale=3.0, ignore="random",
        seed=seed,
    )  # fmt: skip
    return case_payload(spec)


def sequential(pool: WorkerPool, size: str, tp: int, examples: int) -> dict:
    """One `pool.run` per example, as a Hypothesis search drives the pool."""
    pool.run(CASE_JOB, case(size, tp, seed=10**6), tp)  # warm-up
    walls, jobs, computes = [], [], []
    began = time.perf_counter()
    for seed in range(examples):
        payload = case(size, tp, seed)
        start = time.perf_counter()
        results = pool.run(CASE_JOB, payload, tp)
        walls.append(time.perf_counter() - start)
        jobs.append(pool.last_stats[0].worker_s)
        computes.append(max(result["compute_s"] for result in results))
    total = time.perf_counter() - began
    wall, job, compute = (statistics.median(x) for x in (walls, jobs, computes))
    return {
        "size": size, "tp": tp, "examples": examples, "examples_per_s": examples / total,
        "wall_ms": 1e3 * wall, "job_ms": 1e3 * job, "compute_ms": 1e3 * compute,
        "pool_overhead": (wall - job) / compute, "build_overhead": (job - compute) / compute,
    }  # fmt: skip


def concurrent(pool: WorkerPool, size: str, tp: int, examples: int) -> float:
    """Examples per second with `pool.map` filling every disjoint TP slot at once."""
    cases = [case(size, tp, seed) for seed in range(examples)]
    began = time.perf_counter()
    pool.map(CASE_JOB, cases, tp)
    return examples / (time.perf_counter() - began)


def collectives(pool: WorkerPool, tp: int) -> dict[str, int]:
    inner = {"job": CASE_JOB, "payload": case("small", tp, seed=1)}
    return pool.run("verify.distributed.diagnostics:count_collectives", inner, tp)[0]["collectives"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", type=int, default=40, help="examples per TP degree (small)")
    parser.add_argument("--medium", type=int, default=8, help="examples per TP degree (medium)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world-size", type=int, default=None, help="default: 4 CPU ranks / GPUs")
    parser.add_argument("--out", type=Path, default=Path("results/pool_bench.json"))
    args = parser.parse_args()
    report: dict = {"load_before": load(), "cpus": os.cpu_count(), "torch": torch.__version__}
    report["device"] = args.device
    report["python"] = platform.python_version()
    starts = []
    for _ in range(2):
        began = time.perf_counter()
        pool = WorkerPool(world_size=args.world_size, device=args.device, timeout_s=120)
        starts.append(time.perf_counter() - began)
        if len(starts) < 2:
            pool.close()
    report["start_s"] = starts
    rows = []
    with pool:
        report["idle_cpu_percent"] = idle_cpu_percent(pool.pids, 2.0)
        report["collectives"] = {tp: collectives(pool, tp) for tp in pool.tp_sizes}
        for size, examples in (("small", args.small), ("medium", args.medium)):
            for tp in pool.tp_sizes:
                row = sequential(pool, size, tp, examples)
                if tp < pool.world_size:
                    row["map_examples_per_s"] = concurrent(pool, size, tp, examples)
                rows.append(row)
    report["rows"] = rows
    report["sizes"] = SIZES
    report["case"] = json.loads(case("small", 1, seed=0)["spec"])  # sizes and seed vary
    report["load_after"] = load()
    kind = f"world {pool.world_size}, {'NCCL' if args.device == 'cuda' else 'gloo'}"
    print(f"pool start ({kind}): {starts[0]:.2f} s first, {starts[1]:.2f} s second")
    print(f"idle workers' CPU: {report['idle_cpu_percent']:.1f}% of one core")
    print(f"collectives per lce example by TP degree: {report['collectives']}")
    print(f"load average before/after: {report['load_before']} / {report['load_after']}")
    print("size    tp  ex/s(run)  ex/s(map)  wall_ms  job_ms  compute_ms  pool_ovh  build_ovh")
    for r in rows:
        mapped = f"{r['map_examples_per_s']:9.1f}" if "map_examples_per_s" in r else "        -"
        print(
            f"{r['size']:<7} {r['tp']:>2}  {r['examples_per_s']:9.1f}  {mapped}"
            f"  {r['wall_ms']:7.1f}  {r['job_ms']:6.1f}  {r['compute_ms']:10.1f}"
            f"  {r['pool_overhead']:7.1%}  {r['build_overhead']:8.1%}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
