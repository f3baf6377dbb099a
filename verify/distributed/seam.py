"""The seam between the harness and its workers: the `Pool` protocol, and opening one.

`verify.distributed.WorkerPool` (spawned workers) and `verify.distributed.torchrun_pool.
TorchrunPool` (a torchrun world) both satisfy `Pool`. Every case a campaign, a replay or the
self-test runs goes to a pool, at TP = 1 too: the implementation under test never runs in the
driver (a crash or a hang takes down a worker, not the harness).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from verify.distributed.pool import WorkerPool


class Pool(Protocol):
    """Runs a ``"module:function"`` job on the ranks of a TP group; results by TP rank."""

    device: str  # "cpu" (gloo) or "cuda" (NCCL)
    tp_sizes: Sequence[int]

    def run(
        self, job: str, payload: Any, tp: int, *, timeout_s: float | None = None
    ) -> list[Any]: ...


# Modules a case's worker imports before it says it is ready, so that the first case's deadline
# does not pay for them (lce, the harness's case job and its cases).
CASE_MODULES = ("verify.execution.execute",)


def open_pool(tp: int, device: str, preload: Sequence[str] = CASE_MODULES) -> WorkerPool:
    """Workers for TP degrees up to ``tp`` on ``device`` (use it as a context manager)."""
    return WorkerPool(world_size=tp, device=device, preload=tuple(preload))
