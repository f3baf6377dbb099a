"""The faults a pool reports: a job that raised, a rank that died, a rank that hung.

Each carries the rank, the job path and the payload, so the driver can save the case and replay it.
"""

from __future__ import annotations

import signal
from typing import Any

_REPR_LIMIT = 400


def describe(job: str, payload: Any) -> str:
    """``module:function(payload)`` with the payload's repr cut to a readable length."""
    text = repr(payload)
    if len(text) > _REPR_LIMIT:
        text = text[:_REPR_LIMIT] + f"... [{len(text) - _REPR_LIMIT} more chars]"
    return f"{job}({text})"


class PoolError(RuntimeError):
    """Base of every pool fault; ``rank`` is the first faulty global rank."""

    def __init__(self, message: str, *, rank: int, job: str | None, payload: Any) -> None:
        super().__init__(message)
        self.rank = rank
        self.job = job
        self.payload = payload


class WorkerError(PoolError):
    """A job raised on ``rank`` (``ranks``: all that raised); ``traceback`` is the worker's.

    ``stuck`` lists ranks that never finished the job (e.g. left waiting in a collective); when it
    is non-empty the pool is rebuilt before the next job.
    """

    def __init__(
        self, *, ranks: list[int], job: str, payload: Any, traceback: str, stuck: list[int]
    ) -> None:
        rank = ranks[0]
        others = f" (also raised on ranks {ranks[1:]})" if len(ranks) > 1 else ""
        after = f"; ranks {stuck} never finished (left in a collective?)" if stuck else ""
        message = (
            f"rank {rank} raised while running {describe(job, payload)}{others}{after}\n"
            f"--- traceback from rank {rank} ---\n{traceback}"
        )
        super().__init__(message, rank=rank, job=job, payload=payload)
        self.ranks = ranks
        self.traceback = traceback
        self.stuck = stuck

    @property
    def pool_intact(self) -> bool:
        """True when every rank of the job answered, so the workers are still in step."""
        return not self.stuck


class WorkerDied(PoolError):
    """The process of ``rank`` exited; ``exit_code`` as subprocess reports it (negative: signal)."""

    def __init__(self, *, rank: int, exit_code: int | None, job: str | None, payload: Any) -> None:
        message = f"rank {rank} died {_during(job, payload)} ({exit_text(exit_code)})"
        super().__init__(message, rank=rank, job=job, payload=payload)
        self.exit_code = exit_code


class WorkerHung(PoolError):
    """``ranks`` sent no reply within ``timeout_s`` (e.g. a collective some rank never joined)."""

    def __init__(
        self,
        *,
        ranks: list[int],
        answered: list[int],
        timeout_s: float,
        job: str | None,
        payload: Any,
    ) -> None:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        message = (
            f"{who} hung {_during(job, payload)}: no reply after {timeout_s:.1f} s "
            f"(ranks that answered: {answered})"
        )
        super().__init__(message, rank=ranks[0], job=job, payload=payload)
        self.ranks = ranks
        self.answered = answered
        self.timeout_s = timeout_s


def _during(job: str | None, payload: Any) -> str:
    if job is None:
        return "outside a job (start-up or idle; its stderr shows why)"
    return f"while running {describe(job, payload)}"


def exit_text(exit_code: int | None) -> str:
    """How a process ended, in words: ``killed by SIGABRT``, ``exit code 3``."""
    if exit_code is None:
        return "exit code unknown"
    if exit_code < 0:
        try:
            return f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"killed by signal {-exit_code}"
    return f"exit code {exit_code}"
