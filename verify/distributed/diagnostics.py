"""Small real jobs that exercise the pool itself: collectives, and the faults it must survive.

Each is ``fn(payload, ctx)``; the fault jobs act on one chosen TP rank so the others are left
waiting in a collective, as in a real mismatched-collective bug.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from verify.distributed.worker import JobContext


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
        dist.all_reduce(torch.zeros(1, device=ctx.device), group=ctx.tp_group)


def exit_on(payload: dict, ctx: JobContext) -> None:
    """After one all-reduce, TP rank ``payload['tp_rank']`` exits the process (``os._exit``)
    while the others enter a second all-reduce."""
    dist.all_reduce(torch.ones(1, device=ctx.device), group=ctx.tp_group)
    if ctx.tp_rank == payload["tp_rank"]:
        os._exit(payload.get("code", 3))
    dist.all_reduce(torch.ones(1, device=ctx.device), group=ctx.tp_group)


def skip_collective_on(payload: dict, ctx: JobContext) -> int:
    """Every TP rank but ``payload['tp_rank']`` enters an all-reduce: they hang."""
    if ctx.tp_rank != payload["tp_rank"]:
        dist.all_reduce(torch.ones(1, device=ctx.device), group=ctx.tp_group)
    return ctx.rank


def pid(payload: object, ctx: JobContext) -> int:
    """This worker's process id (tests check that closed pools leave no process behind)."""
    return os.getpid()


def sleep(payload: dict, ctx: JobContext) -> float:
    """Sleep ``payload['seconds']`` then return them (timing and timeout checks)."""
    time.sleep(payload["seconds"])
    return payload["seconds"]


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
