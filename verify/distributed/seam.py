"""The seam between the harness and its workers: the `Pool` protocol and when a case needs one.

`verify.distributed.WorkerPool` (spawned workers) and `verify.distributed.torchrun_pool.
TorchrunPool` (a torchrun world) both satisfy `Pool`; `needs_pool` is the one rule for where a case
runs, `open_pool` opens workers when that rule asks for them.
"""

from __future__ import annotations

import contextlib
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


def needs_pool(tp: int, device: str) -> bool:
    """Whether a case at TP degree ``tp`` on ``device`` runs in workers: TP > 1 needs one process
    per rank, and on CUDA every case does (each worker owns its GPU; the driver stays off CUDA)."""
    return tp > 1 or device == "cuda"


def open_pool(tp: int, device: str) -> contextlib.AbstractContextManager[Pool | None]:
    """Workers for TP degrees up to ``tp`` on ``device`` when `needs_pool` asks for them, else a
    context holding None (everything runs in this process)."""
    if needs_pool(tp, device):
        return WorkerPool(world_size=tp, device=device)
    return contextlib.nullcontext(None)
