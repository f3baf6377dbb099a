"""Start local worker processes and end them without leaving orphans.

Workers are forked by multiprocessing's fork server, which imports torch and the harness's case
modules once: a worker (re)starts in a fraction of a second instead of importing torch anew (two
to three seconds of CPU each), which matters where workers are replaced often: a kernel that
crashes them, every campaign's start. The fork server never touches CUDA or a thread pool, so
what it forks is clean. Each worker is its own session (process group) holding one end of a pipe;
ending a worker kills its whole process group. Workers also exit by themselves when the driver
disappears.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from verify.distributed import worker
from verify.distributed.channels import PipeChannel
from verify.distributed.messages import Shutdown

# What the fork server imports before forking (its children have them loaded); a pool's own
# `preload` adds to it when it starts the server. DTensor (a case's weight may be one) costs
# 0.8 s to import on an idle core: once here instead of in every worker that meets one.
FORK_PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.tensor", "verify.distributed.worker",
)  # fmt: skip
_CONTEXT = multiprocessing.get_context("forkserver")


@dataclass
class WorkerProcess:
    """A live worker: its global rank, its process, and the driver's end of its channel."""

    rank: int
    process: Any  # multiprocessing.Process
    channel: PipeChannel

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code once the process has ended (negative: killed by that signal), or None
        when it still runs after ``timeout`` seconds."""
        self.process.join(timeout)
        return self.process.exitcode

    def running(self) -> bool:
        return self.process.exitcode is None


def spawn(
    rank: int, world_size: int, store_path: str, device: str, threads: int, preload: tuple[str, ...]
) -> WorkerProcess:
    """Start a `verify.distributed.worker.run` process for ``rank`` (it then joins the world).

    The worker takes this process's environment now (the fork server's dates from its own start)
    and its ``threads``; ``preload`` is imported by the fork server when it starts here, else by
    the worker itself."""
    _CONTEXT.set_forkserver_preload([*FORK_PRELOAD, *preload])  # no effect once it runs
    ours, theirs = _CONTEXT.Pipe()
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    args = worker.WorkerArgs(
        os.getpid(), rank, world_size, store_path, device, threads, preload, environment
    )
    process = _CONTEXT.Process(
        target=worker.run, args=(theirs, args), name=f"lce-worker-{rank}", daemon=True
    )
    process.start()
    theirs.close()
    return WorkerProcess(rank, process, PipeChannel(ours))


def stop(workers: list[WorkerProcess], grace_s: float) -> None:
    """Ask every worker to exit, wait up to ``grace_s``, then kill what is left."""
    for worker_process in workers:
        with contextlib.suppress(OSError):  # already dead: kill() reaps it
            worker_process.channel.send(Shutdown())
    deadline = time.monotonic() + grace_s
    for worker_process in workers:
        worker_process.wait(max(deadline - time.monotonic(), 0.0))
    kill(workers)


def kill(workers: list[WorkerProcess]) -> None:
    """SIGKILL each worker's process group (the worker and anything it started), then reap it.

    The group outlives a worker that has exited when the implementation left processes in it (a
    compile server, say), and its id stays taken while it has members, so it is killed either way.
    """
    for worker_process in workers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker_process.pid, signal.SIGKILL)
        if worker_process.running():
            with contextlib.suppress(ProcessLookupError):  # not yet its own session
                os.kill(worker_process.pid, signal.SIGKILL)
    for worker_process in workers:
        worker_process.wait()
        worker_process.channel.close()
