"""Small real jobs that exercise the pool itself: collectives, and the faults it must survive.

Each is ``fn(payload, ctx)``; the fault jobs act on one chosen TP rank so the others are left
waiting in a collective, as in a real mismatched-collective bug.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from verify.distributed.worker import JobContext, load_function


def allreduce_sum(payload: dict, ctx: JobContext) -> dict:
    """All-reduce (SUM) ``payload['values'][tp_rank]`` over the TP group; returns what it saw."""
    local = torch.tensor(payload["values"][ctx.tp_rank], dtype=torch.float64, device=ctx.device)
    total = local.clone()
    dist.all_reduce(total, group=ctx.tp_group)
    return {"rank": ctx.rank, "tp_rank": ctx.tp_rank, "tp_size": ctx.tp_size, "sum": total}


def raise_on(payload: dict, ctx: JobContext) -> None:
    """Raise ``ValueError`` on TP rank ``payload['tp_rank']`` before any collective; the rest
    join an all-reduce that can then never complete."""
    if ctx.tp_rank == payload["tp_rank"]:
        raise ValueError(f"planted failure on tp_rank {ctx.tp_rank}: {payload['message']}")
    if payload.get("others_wait", False):
        _allreduce_now(ctx)


def exit_on(payload: dict, ctx: JobContext) -> None:
    """After one all-reduce, TP rank ``payload['tp_rank']`` exits the process (``os._exit``)
    while the others enter a second all-reduce."""
    _allreduce_now(ctx)
    if ctx.tp_rank == payload["tp_rank"]:
        os._exit(payload.get("code", 3))
    _allreduce_now(ctx)


def skip_collective_on(payload: dict, ctx: JobContext) -> int:
    """Every TP rank but ``payload['tp_rank']`` enters an all-reduce: they hang."""
    if ctx.tp_rank != payload["tp_rank"]:
        _allreduce_now(ctx)
    return ctx.rank


def _allreduce_now(ctx: JobContext) -> float:
    """An all-reduce that has completed on return (NCCL enqueues asynchronously; `item` waits)."""
    value = torch.ones(1, device=ctx.device)
    dist.all_reduce(value, group=ctx.tp_group)
    return value.item()


def start_a_process(payload: dict, ctx: JobContext) -> int:
    """Run ``abs(-3)`` in a process pool of start method ``payload['method']``, as a kernel under
    test may (QuACK compiles in a forkserver pool); returns the result."""
    context = multiprocessing.get_context(payload["method"])
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(abs, -3).result(timeout=60.0)


def start_a_sleeper(payload: object, ctx: JobContext) -> int:
    """Start a process that sleeps ten minutes and leave it running (an implementation's
    compile server, say); returns its pid."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid


def pid(payload: object, ctx: JobContext) -> int:
    """This worker's process id (tests check that closed pools leave no process behind)."""
    return os.getpid()


def self_check(pool: Any, argv: list[str]) -> int:
    """Driver: an exact all-reduce at every TP degree of ``pool``; prints a line per degree and
    returns 0 when every rank saw the right sum (for ``verify.distributed.launch --driver``)."""
    values = [float(2**rank) for rank in range(pool.world_size)]
    failures = 0
    for tp in pool.tp_sizes:
        results = pool.run("verify.distributed.diagnostics:allreduce_sum", {"values": values}, tp)
        sums = [float(result["sum"]) for result in results]
        expected = sum(values[:tp])  # powers of two: exact in float64
        ok = sums == [expected] * tp
        failures += not ok
        print(f"tp={tp}: sums {sums}, expected {expected}: {'ok' if ok else 'WRONG'}", flush=True)
    return 1 if failures else 0


_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
    "broadcast", "barrier", "all_to_all_single",
)  # fmt: skip


def count_collectives(payload: dict, ctx: JobContext) -> dict:
    """Run ``payload['job']`` on ``payload['payload']`` counting torch.distributed collectives
    (called through ``torch.distributed.<name>``); returns ``{"result", "collectives"}``."""
    calls: dict[str, int] = {}
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counted(name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, counted(name, original))
    try:
        result = load_function(payload["job"])(payload["payload"], ctx)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {"result": result, "collectives": calls}
