"""Worker-side jobs for the campaign's fault tests: a rank process that dies mid-case, one whose
first case in each process is slow."""

from __future__ import annotations

import os
import time
from typing import Any

from verify.execution.execute import case_job


def die(payload: dict[str, Any], ctx: Any) -> None:
    """Every rank exits at once, as a segfaulting kernel would take its process down."""
    os._exit(3)


STALL_FILE = "LCE_TEST_STALL_FILE"  # environment: where the last rank writes its pid, then stalls


def stall_once(payload: dict[str, Any], ctx: Any) -> Any:
    """The real case job, except that the first time the job's last TP rank runs it, that rank
    writes its pid to ``$LCE_TEST_STALL_FILE`` and sleeps (for the test to SIGKILL it mid-job)."""
    path = os.environ[STALL_FILE]
    if ctx.tp_rank == ctx.tp_size - 1 and not os.path.exists(path):
        with open(path + ".tmp", "w") as handle:
            handle.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        time.sleep(120)
    return case_job(payload, ctx)


SLOW_FIRST_S = "LCE_TEST_SLOW_FIRST_S"  # environment: seconds the first case in a process sleeps
_slept: list[bool] = []


def slow_first_call(payload: dict[str, Any], ctx: Any) -> Any:
    """The real case job, after ``$LCE_TEST_SLOW_FIRST_S`` seconds of sleep on the first case in
    this process: a kernel JIT-compiled on its first call, in every fresh worker again."""
    if not _slept:
        _slept.append(True)
        time.sleep(float(os.environ[SLOW_FIRST_S]))
    return case_job(payload, ctx)


def peer_raises(payload: dict[str, Any], ctx: Any) -> None:
    """A peer's job that raises on every rank, as megatron-core missing from a worker would."""
    raise ModuleNotFoundError("No module named 'megatron'")
