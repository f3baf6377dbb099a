"""Messages between the driver and a worker rank: one request in, one reply out, plain pickle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JobRequest:
    """Run ``job`` (``"module:function"``) on ``payload`` in this rank's TP=``tp`` subgroup."""

    seq: int
    job: str
    payload: Any
    tp: int


@dataclass(frozen=True)
class Shutdown:
    """Leave the process group and exit."""


@dataclass(frozen=True)
class Ready:
    """Sent once by a worker after joining the world and making every TP subgroup."""

    rank: int
    pid: int
    seconds: float


@dataclass(frozen=True)
class Reply:
    """Outcome of one request: ``result`` pickled (``ok``) or the formatted traceback (``error``).

    ``seconds`` is the time spent inside the job function on this rank.
    """

    seq: int
    rank: int
    ok: bool
    result: bytes | None
    error: str | None
    seconds: float
