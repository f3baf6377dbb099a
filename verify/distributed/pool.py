"""`WorkerPool`: long-lived worker ranks on this host that run jobs in TP=1/2/4 subgroups.

gloo on CPU, NCCL on CUDA (one process per GPU). A dead or hung rank tears the pool down; the next
job starts a fresh one, so a property search goes on. No worker outlives the driver.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

import torch

from verify.distributed import processes
from verify.distributed.dispatch import Dispatch, JobStats
from verify.distributed.errors import PoolError, WorkerDied, WorkerError, WorkerHung
from verify.distributed.messages import Ready
from verify.distributed.rendezvous import tp_sizes


class WorkerPool:
    """``world_size`` worker processes (default: 4 on CPU, every GPU on CUDA), started at once.

    ``pool.run(job, payload, tp)`` calls ``job`` (``"module:function"``) as ``fn(payload, ctx)`` on
    ranks ``[0, tp)`` and returns the results in TP-rank order. ``timeout_s`` bounds every job
    (override per call); ``start_timeout_s`` bounds a (re)start. Use as a context manager or call
    `close`. Not thread-safe: one driver thread uses a pool.
    """

    def __init__(
        self,
        world_size: int | None = None,
        device: str = "cpu",
        *,
        timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
        grace_s: float = 2.0,
        threads_per_worker: int | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        self.device = device
        self.world_size = _world_size(world_size, device)
        self.tp_sizes = tp_sizes(self.world_size)
        self.timeout_s = _positive("timeout_s", timeout_s)
        self.start_timeout_s = _positive("start_timeout_s", start_timeout_s)
        self.grace_s = _positive("grace_s", grace_s)
        cores = _usable_cores()
        self.threads_per_worker = threads_per_worker or max(1, cores // self.world_size)
        self.preload = tuple(preload)
        self.starts = 0  # how many times the workers were (re)built
        self.start_seconds = 0.0  # wall time of the latest (re)build
        self.last_stats: list[JobStats] = []
        self._workers: list[processes.WorkerProcess] = []
        self._tempdir: str | None = None
        self._finalizer: weakref.finalize | None = None
        self._seq = 0
        self._closed = False
        self._start()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers (empty between a fault and the rebuild)."""
        return [worker.pid for worker in self._workers]

    @property
    def tempdir(self) -> str | None:
        """The directory holding this generation's FileStore (removed at teardown)."""
        return self._tempdir

    def run(self, job: str, payload: Any, tp: int, *, timeout_s: float | None = None) -> list[Any]:
        """Run ``job`` on ranks ``[0, tp)``; returns one result per TP rank (index = ``tp_rank``).

        Raises `WorkerError` (a rank raised), `WorkerDied` or `WorkerHung` (then the pool is
        rebuilt on the next call). Never waits longer than ``timeout_s`` (+ ``grace_s``).
        """
        return self.map(job, [payload], tp, timeout_s=timeout_s)[0]

    def map(
        self, job: str, payloads: Sequence[Any], tp: int, *, timeout_s: float | None = None
    ) -> list[list[Any]]:
        """`run` for many payloads, several at once on disjoint TP slots (world_size // tp)."""
        self._check_call(job, payloads, tp)
        timeout = _positive("timeout_s", timeout_s) if timeout_s is not None else self.timeout_s
        if not self._workers:
            self._start()
        dispatch = Dispatch(self._workers, job, list(payloads), tp, self._seq)
        try:
            results, self.last_stats = dispatch.run(timeout, self.grace_s)
        except WorkerError as error:
            if not error.pool_intact:
                self._discard()
            raise
        except BaseException:  # died, hung, interrupted: the workers are out of step
            self._discard()
            raise
        finally:
            self._seq = dispatch.seq
        return results

    def reset(self) -> None:
        """Kill the workers now; the next job starts fresh ones (after a job that left its
        process unusable, e.g. a CUDA context broken by an illegal memory access)."""
        self._discard()

    def close(self) -> None:
        """Stop the workers (Shutdown, then SIGKILL after a grace) and remove the temp dir."""
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()
        self._workers, self._tempdir, self._finalizer = [], None, None

    def _check_call(self, job: str, payloads: Sequence[Any], tp: int) -> None:
        if self._closed:
            raise RuntimeError("this WorkerPool is closed; create a new one")
        module, sep, function = job.partition(":") if isinstance(job, str) else ("", "", "")
        if not (module and sep and function):
            raise ValueError(f"job must be a 'package.module:function' string, got {job!r}")
        if tp not in self.tp_sizes:
            raise ValueError(
                f"tp={tp} is not offered by this pool (TP degrees {self.tp_sizes}); "
                f"use world_size >= {tp} divisible by {tp}"
            )
        try:
            pickle.dumps(list(payloads))
        except Exception as exc:
            raise TypeError(f"payloads must be picklable for the workers: {exc}") from exc

    def _start(self) -> None:
        """Spawn every rank into a fresh FileStore directory and wait for all to be ready."""
        began = time.perf_counter()
        tempdir = tempfile.mkdtemp(prefix="lce-pool-")
        workers: list[processes.WorkerProcess] = []
        self._finalizer = weakref.finalize(self, _teardown, workers, tempdir, self.grace_s)
        self._workers, self._tempdir = workers, tempdir
        store = os.path.join(tempdir, "store")
        try:
            for rank in range(self.world_size):
                worker = processes.spawn(
                    rank, self.world_size, store, self.device, self.threads_per_worker, self.preload
                )
                workers.append(worker)
            _await_ready(workers, self.start_timeout_s)
        except BaseException:
            self._discard()
            raise
        self.starts += 1
        self.start_seconds = time.perf_counter() - began

    def _discard(self) -> None:
        """Kill this generation at once (no grace: it is out of step) and forget it."""
        if self._finalizer is not None:
            self._finalizer.detach()
            _teardown(self._workers, self._tempdir, 0.0)
        self._workers, self._tempdir, self._finalizer = [], None, None


def _await_ready(workers: list[processes.WorkerProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    by_conn = {worker.channel.conn: worker for worker in workers}
    ready: set[int] = set()
    while len(ready) < len(workers):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = [w.rank for w in workers if w.rank not in ready]
            raise WorkerHung(
                ranks=missing, answered=sorted(ready), timeout_s=timeout_s, job=None, payload=None
            )
        for conn in wait([c for c, w in by_conn.items() if w.rank not in ready], remaining):
            worker = by_conn[conn]
            try:
                message = worker.channel.recv()
            except (EOFError, OSError):
                code = worker.wait()
                raise WorkerDied(rank=worker.rank, exit_code=code, job=None, payload=None) from None
            if not isinstance(message, Ready):
                text = f"rank {worker.rank} sent {message!r} before Ready"
                raise PoolError(text, rank=worker.rank, job=None, payload=None)
            ready.add(worker.rank)


def _teardown(workers: list[processes.WorkerProcess], tempdir: str | None, grace_s: float) -> None:
    """Stop (``grace_s`` > 0) or kill the workers, then remove the temp dir. Also runs at exit."""
    if grace_s > 0:
        processes.stop(workers, grace_s)
    else:
        processes.kill(workers)
    if tempdir is not None:
        shutil.rmtree(tempdir, ignore_errors=True)


def _world_size(world_size: int | None, device: str) -> int:
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' (gloo) or 'cuda' (NCCL), got {device!r}")
    if device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise ValueError("device='cuda' but no GPU is visible; use device='cpu' (gloo)")
        world_size = gpus if world_size is None else world_size
        if world_size > gpus:
            raise ValueError(f"world_size={world_size} needs one GPU per rank; {gpus} visible")
    world_size = 4 if world_size is None else world_size
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def _positive(name: str, value: float) -> float:
    if not value > 0:
        raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
    return float(value)


def _usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: campaigns run side by side each on
    their own cores, `ci/seeded_campaigns.py`), else all of the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
