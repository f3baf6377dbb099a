"""`TorchrunPool`: the driver side of a world that torchrun started (rank 0 drives and computes).

Same `run`/`map`/`close` as `WorkerPool`, but the world is fixed: after a died or hung rank it
refuses further jobs (torchrun's restart policy takes over) instead of rebuilding itself.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from verify.distributed.channels import StoreChannel
from verify.distributed.errors import PoolError, WorkerError, WorkerHung
from verify.distributed.messages import JobRequest, Reply, Shutdown
from verify.distributed.rendezvous import Topology, tp_sizes
from verify.distributed.worker import execute


class TorchrunPool:
    """Rank 0 of a torchrun world; the other ranks run `verify.distributed.worker.serve`."""

    def __init__(self, store: dist.Store, topology: Topology, *, timeout_s: float = 600.0) -> None:
        self.topology = topology
        self.world_size = topology.world_size
        self.device = topology.device.type
        self.tp_sizes = tp_sizes(self.world_size)
        self.timeout_s = timeout_s
        self._channels = {
            rank: StoreChannel(store, rank, driver_side=True) for rank in range(1, self.world_size)
        }
        self._seq = 0
        self._broken: PoolError | None = None

    def run(self, job: str, payload: Any, tp: int, *, timeout_s: float | None = None) -> list[Any]:
        """Run ``job`` on ranks ``[0, tp)`` (this process is TP rank 0); results by TP rank."""
        if self._broken is not None:
            raise RuntimeError(f"this torchrun world is out of step after: {self._broken}")
        if tp not in self.tp_sizes:
            raise ValueError(f"tp={tp} is not offered by this world (TP degrees {self.tp_sizes})")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        request = JobRequest(self._seq, job, payload, tp)
        self._seq += 1
        for rank in range(1, tp):
            self._channels[rank].send(request)
        deadline = time.monotonic() + timeout
        replies = [self._run_locally(request, timeout)]
        for rank in range(1, tp):
            replies.append(self._reply(rank, deadline, replies, request, timeout))
        failed = [reply for reply in replies if not reply.ok]
        if failed:
            ranks = [reply.rank for reply in failed]
            error = failed[0].error or ""
            raise WorkerError(ranks=ranks, job=job, payload=payload, traceback=error, stuck=[])
        return [pickle.loads(reply.result or b"") for reply in replies]

    def map(
        self, job: str, payloads: Sequence[Any], tp: int, *, timeout_s: float | None = None
    ) -> list[list[Any]]:
        """`run` for each payload in turn (rank 0 takes part in every job)."""
        return [self.run(job, payload, tp, timeout_s=timeout_s) for payload in payloads]

    def close(self) -> None:
        """Release the serving ranks (they leave the world and exit)."""
        if self._broken is None:
            for channel in self._channels.values():
                channel.send(Shutdown())

    def _run_locally(self, request: JobRequest, timeout_s: float) -> Reply:
        """Rank 0's share, in a thread so that a hung collective cannot stall the driver."""
        box: list[Reply] = []
        thread = threading.Thread(target=lambda: box.append(execute(request, self.topology)))
        thread.daemon = True
        thread.start()
        thread.join(timeout_s)
        if not box:
            answered = [r for r in range(1, request.tp) if self._channels[r].ready()]
            raise self._hung(request, [0], answered, timeout_s)
        return box[0]

    def _reply(
        self, rank: int, deadline: float, done: list[Reply], request: JobRequest, timeout_s: float
    ) -> Reply:
        remaining = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        try:
            return self._channels[rank].recv(timeout=remaining)
        except TimeoutError:
            later = range(rank, request.tp)
            missing = [r for r in later if not self._channels[r].ready()]
            answered = [reply.rank for reply in done] + [r for r in later if r not in missing]
            raise self._hung(request, missing, answered, timeout_s) from None

    def _hung(
        self, request: JobRequest, ranks: list[int], answered: list[int], timeout_s: float
    ) -> PoolError:
        """The world is out of step from now on: remember why, and refuse further jobs."""
        self._broken = WorkerHung(
            ranks=ranks,
            answered=answered,
            timeout_s=timeout_s,
            job=request.job,
            payload=request.payload,
        )
        return self._broken
