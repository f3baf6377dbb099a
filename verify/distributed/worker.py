"""A worker rank: join the world, then serve job requests until told to stop.

Started by a local pool (`run`, one process per rank, forked by its fork server) and, under
torchrun, by
`verify.distributed.launch` on every rank but the driver; both end in `serve`.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
import torch.distributed as dist

from verify.distributed import rendezvous
from verify.distributed.channels import PipeChannel
from verify.distributed.messages import JobRequest, Ready, Reply, Shutdown


@dataclass(frozen=True)
class JobContext:
    """What a job function learns about where it runs: ``fn(payload, ctx) -> result``.

    ``tp_group`` is a real process group of ``tp_size`` ranks (size 1 at TP=1); ``tp_rank`` is this
    rank's index in it; ``device`` is ``cpu`` (gloo) or this rank's ``cuda:i`` (NCCL).
    """

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    tp_group: dist.ProcessGroup
    tp_ranks: tuple[int, ...]
    device: torch.device


class Channel(Protocol):
    def send(self, message: Any) -> None: ...
    def recv(self) -> Any: ...


def load_function(path: str) -> Callable[[Any, JobContext], Any]:
    """The function named ``"package.module:function"``, imported once per process."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected a 'package.module:function' path, got {path!r}")
    return _import_function(module_name, attr)


@functools.cache
def _import_function(module_name: str, attr: str) -> Callable[[Any, JobContext], Any]:
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{module_name}:{attr} is not callable")
    return target


def context(topology: rendezvous.Topology, tp: int) -> JobContext:
    """This rank's `JobContext` in its TP=``tp`` subgroup."""
    group, ranks = topology.groups[tp]
    return JobContext(
        rank=topology.rank,
        world_size=topology.world_size,
        tp_rank=ranks.index(topology.rank),
        tp_size=tp,
        tp_group=group,
        tp_ranks=ranks,
        device=topology.device,
    )


def execute(request: JobRequest, topology: rendezvous.Topology) -> Reply:
    """Run one request; any exception (also an unpicklable result) becomes an error reply."""
    start = time.perf_counter()
    try:
        fn = load_function(request.job)
        result = fn(request.payload, context(topology, request.tp))
        if topology.device.type == "cuda":  # a kernel's async error belongs to this job
            torch.cuda.synchronize(topology.device)
        data = pickle.dumps(_to_cpu(result), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        seconds = time.perf_counter() - start
        return Reply(request.seq, topology.rank, False, None, traceback.format_exc(), seconds)
    return Reply(request.seq, topology.rank, True, data, None, time.perf_counter() - start)


def serve(channel: Channel, topology: rendezvous.Topology) -> None:
    """Answer requests one at a time until `Shutdown`; blocks on the channel while idle."""
    while True:
        message = channel.recv()
        if isinstance(message, Shutdown):
            return
        channel.send(execute(message, topology))


def _to_cpu(value: Any) -> Any:
    """Results cross process boundaries: CUDA tensors (also inside lists/tuples/dicts) go to CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _watch_parent(parent_pid: int, store_dir: str) -> None:
    """Leave when the driver is gone, even while a collective hangs (no orphans)."""

    def watch() -> None:
        while _alive(parent_pid):
            time.sleep(0.5)
        _driver_gone(store_dir)

    threading.Thread(target=watch, name="lce-parent-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (a reused pid): still someone's
        return True
    return True


def _driver_gone(store_dir: str) -> None:
    """Remove the store's directory (a killed driver could not) and end this worker's process
    group at once: the worker and whatever the implementation started (a compile pool, a server)."""
    shutil.rmtree(store_dir, ignore_errors=True)
    os.killpg(os.getpgrp(), signal.SIGKILL)  # the worker leads its group (`run`: setsid)
    os._exit(70)


@dataclass(frozen=True)
class WorkerArgs:
    """What a local-pool worker is started with (`verify.distributed.processes.spawn`)."""

    parent_pid: int
    rank: int
    world_size: int
    store: str
    device: str
    threads: int
    preload: tuple[str, ...]
    environment: dict[str, str]  # the driver's, at the worker's start


def run(conn: Connection, args: WorkerArgs) -> None:
    """Entry of a local-pool worker, forked by the pool's fork server: become a session of its own
    (the pool kills the whole group), take the driver's environment, join the world, serve."""
    os.setsid()
    # The implementation under test may start processes of its own (QuACK compiles its kernels
    # in a process pool), which a daemonic process may not. The flag is the driver's
    # business (it ends its workers at exit, whole process groups), so the worker drops it.
    multiprocessing.current_process().daemon = False
    os.environ.clear()
    os.environ.update(args.environment)
    store_dir = os.path.dirname(args.store)
    _watch_parent(args.parent_pid, store_dir)
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    channel = PipeChannel(conn)
    for module in args.preload:
        importlib.import_module(module)
    store = rendezvous.file_store(args.store, args.world_size)
    topology = rendezvous.join(store, args.rank, args.world_size, args.device, args.rank)
    channel.send(Ready(args.rank, os.getpid(), time.perf_counter() - start))
    try:
        serve(channel, topology)
    except EOFError:  # the driver's end of the channel closed: it died without a Shutdown
        _driver_gone(store_dir)
    rendezvous.leave()
    # Skip interpreter teardown (about 1 s of torch finalizers per worker on 2 busy cores).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
