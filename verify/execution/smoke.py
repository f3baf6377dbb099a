"""Smoke test of a local pool on this machine: collectives, the harness's case job on lce, and
fault recovery.

    python -m verify.execution.smoke [--device cuda] [--world-size N]

Prints one line per check and exits non-zero if any check fails (e.g. on a new GPU host).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from verify.cases.spec import CaseSpec
from verify.distributed.errors import PoolError, WorkerDied, WorkerError, WorkerHung
from verify.distributed.pool import WorkerPool
from verify.execution.execute import CASE_JOB, case_payload

DIAG = "verify.distributed.diagnostics"


def exact_sums(pool: WorkerPool, tp: int) -> None:
    """All-reduce powers of two over ranks ``[0, tp)``: every rank must see the exact sum."""
    values = [float(2**rank) for rank in range(pool.world_size)]
    sums = [float(r["sum"]) for r in pool.run(f"{DIAG}:allreduce_sum", {"values": values}, tp)]
    assert sums == [sum(values[:tp])] * tp, (tp, sums)


def tp_gaps(pool: WorkerPool, backend: str) -> dict[int, float]:
    """Largest |TP=k - TP=1| over logprobs, entropy, grad_hidden and grad_weight (fp32)."""
    # V = 509 is prime: no shard lines up with a tile.
    case = CaseSpec(tokens=41, hidden_size=40, vocab=509, temperature=0.7, backend=backend, seed=7)
    runs = {tp: pool.run(CASE_JOB, case_payload(case.with_(tp=tp)), tp) for tp in pool.tp_sizes}
    single = runs[1][0]
    gaps = {}
    for tp, results in runs.items():
        grad_weight = torch.cat([r["grad_weight"] for r in results])
        pairs = [(results[0][n], single[n]) for n in ("logprobs", "entropy", "grad_hidden")]
        pairs.append((grad_weight, single["grad_weight"]))
        gaps[tp] = max((a.double() - b.double()).abs().max().item() for a, b in pairs)
    return gaps


def expect(pool: WorkerPool, fault: type[PoolError], job: str, payload: dict, **kw: float) -> str:
    """``pool.run(job, payload, largest tp)`` must raise ``fault``; returns its time and message."""
    exact_sums(pool, 1)  # (re)build first, so the time below is the fault's alone
    began = time.monotonic()
    try:
        pool.run(f"{DIAG}:{job}", payload, pool.tp_sizes[-1], **kw)
    except fault as error:
        return f"{time.monotonic() - began:.2f} s: {str(error).splitlines()[0]}"
    raise AssertionError(f"expected {fault.__name__}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world-size", type=int, default=None)
    args = parser.parse_args()
    with WorkerPool(args.world_size, args.device, timeout_s=120, grace_s=2.0) as pool:
        print(f"start: world {pool.world_size} on {args.device} in {pool.start_seconds:.2f} s")
        for tp in pool.tp_sizes:
            exact_sums(pool, tp)
        print(f"all-reduce at TP {pool.tp_sizes}: exact")
        backends = ("torch", "triton") if args.device == "cuda" else ("torch",)
        failed = 0
        for backend in backends:
            try:
                print(f"lce {backend}: max |TP=k - TP=1| by k: {tp_gaps(pool, backend)}")
            except WorkerError as error:  # a backend bug must not hide the pool's own checks
                failed += 1
                print(f"lce {backend}: FAILED: {str(error).splitlines()[-1]}")
        last = pool.world_size - 1
        print("died:", expect(pool, WorkerDied, "exit_on", {"tp_rank": last}))
        if pool.world_size == 1:
            print("hung, error with waiting peers: skipped (need 2 ranks)")
        else:
            skip = {"tp_rank": last}
            print("hung:", expect(pool, WorkerHung, "skip_collective_on", skip, timeout_s=5))
            wait = {"tp_rank": last, "message": "planted", "others_wait": True}
            print("error:", expect(pool, WorkerError, "raise_on", wait))
        exact_sums(pool, pool.tp_sizes[-1])
        print(f"after faults: pool rebuilt {pool.starts - 1} times, all-reduce exact")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
