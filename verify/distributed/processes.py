"""Start local worker processes and end them without leaving orphans.

Each worker is its own session (process group) holding one end of a socket pair; ending a worker
kills its whole process group. Workers also exit by themselves when the driver disappears.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from verify.distributed.channels import PipeChannel
from verify.distributed.messages import Shutdown


@dataclass
class WorkerProcess:
    """A live worker: its global rank, its process, and the driver's end of its channel."""

    rank: int
    process: subprocess.Popen[bytes]
    channel: PipeChannel

    @property
    def pid(self) -> int:
        return self.process.pid


def spawn(
    rank: int, world_size: int, store_path: str, device: str, threads: int, preload: tuple[str, ...]
) -> WorkerProcess:
    """Start a `verify.distributed.worker.main` process for ``rank`` (it then joins the world)."""
    ours, theirs = socket.socketpair()
    command = [
        sys.executable, "-c", "from verify.distributed.worker import main; main()",
        "--fd", str(theirs.fileno()), "--parent-pid", str(os.getpid()),
        "--rank", str(rank), "--world-size", str(world_size), "--store", store_path,
        "--device", device, "--threads", str(threads), "--preload", ",".join(preload),
    ]  # fmt: skip
    env = dict(os.environ)
    # The worker imports what the driver can import (jobs named by the driver's modules).
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["OMP_NUM_THREADS"] = str(threads)  # idle OpenMP teams spin; keep them as small as asked
    try:
        process = subprocess.Popen(
            command, pass_fds=(theirs.fileno(),), start_new_session=True, env=env
        )
    finally:
        theirs.close()
    return WorkerProcess(rank, process, PipeChannel(Connection(ours.detach())))


def stop(workers: list[WorkerProcess], grace_s: float) -> None:
    """Ask every worker to exit, wait up to ``grace_s``, then kill what is left."""
    for worker in workers:
        with contextlib.suppress(OSError):  # already dead: kill() reaps it
            worker.channel.send(Shutdown())
    deadline = time.monotonic() + grace_s
    for worker in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.process.wait(timeout=max(deadline - time.monotonic(), 0.0))
    kill(workers)


def kill(workers: list[WorkerProcess]) -> None:
    """SIGKILL each worker's process group (the worker and anything it started), then reap it."""
    for worker in workers:
        if worker.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
    for worker in workers:
        worker.process.wait()
        worker.channel.close()
