"""Send one job to TP subgroups, collect the replies, and turn silence or death into a fault.

A TP=k job runs on the disjoint rank slots ``[0, k)``, ``[k, 2k)``, ...; several payloads run
at once on different slots. The driver never waits past a slot's deadline.
"""

from __future__ import annotations

import pickle
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from verify.distributed.errors import PoolError, WorkerDied, WorkerError, WorkerHung
from verify.distributed.messages import JobRequest, Reply
from verify.distributed.processes import WorkerProcess
from verify.distributed.rendezvous import tp_slots


@dataclass(frozen=True)
class JobStats:
    """Timing of one payload: driver wall time (send to last reply) and the slowest rank's time
    inside the job function; their difference is the pool's overhead."""

    wall_s: float
    worker_s: float


@dataclass
class _Slot:
    ranks: tuple[int, ...]
    index: int | None = None  # which payload runs here; None = idle
    seq: int = -1
    sent_at: float = 0.0
    deadline: float = 0.0
    replies: dict[int, Reply] = field(default_factory=dict)


class Dispatch:
    """One `WorkerPool.map` call: payloads in, per-payload per-tp-rank results out."""

    def __init__(
        self, workers: list[WorkerProcess], job: str, payloads: list[Any], tp: int, first_seq: int
    ) -> None:
        self.workers = {w.rank: w for w in workers}
        self.job = job
        self.payloads = payloads
        self.tp = tp
        self.seq = first_seq
        self.slots = [_Slot(ranks) for ranks in tp_slots(len(workers), tp)]
        self.slot_of = {rank: slot for slot in self.slots for rank in slot.ranks}
        self.results: list[list[Any]] = [[] for _ in payloads]
        self.stats: list[JobStats | None] = [None] * len(payloads)
        self.failure: WorkerError | None = None

    def run(self, timeout_s: float, grace_s: float) -> tuple[list[list[Any]], list[JobStats]]:
        """Run every payload; raises the first `PoolError` (after letting busy slots finish)."""
        queue = deque(range(len(self.payloads)))
        while True:
            while self.failure is None and queue and (slot := self._idle_slot()) is not None:
                self._send(slot, queue.popleft(), timeout_s)
            busy = [slot for slot in self.slots if slot.index is not None]
            if not busy:
                break
            now = time.monotonic()
            for slot in busy:
                if now >= slot.deadline:
                    raise self._silence(slot, timeout_s)
            self._receive(min(slot.deadline for slot in busy) - now, grace_s)
        if self.failure is not None:
            raise self.failure
        return self.results, [s for s in self.stats if s is not None]

    def _idle_slot(self) -> _Slot | None:
        return next((slot for slot in self.slots if slot.index is None), None)

    def _send(self, slot: _Slot, index: int, timeout_s: float) -> None:
        slot.index, slot.seq, slot.replies = index, self.seq, {}
        self.seq += 1
        slot.sent_at = time.monotonic()
        slot.deadline = slot.sent_at + timeout_s
        request = JobRequest(slot.seq, self.job, self.payloads[index], self.tp)
        for rank in slot.ranks:
            try:
                self.workers[rank].channel.send(request)
            except OSError:
                raise self._died(rank) from None

    def _receive(self, timeout: float, grace_s: float) -> None:
        """Read every reply that arrives within ``timeout``; a closed channel is a dead worker."""
        by_conn = {w.channel.conn: w for w in self.workers.values()}
        ready = wait(list(by_conn), timeout=max(timeout, 0.0))
        for conn in sorted(ready, key=lambda c: by_conn[c].rank):
            worker = by_conn[conn]
            try:
                reply = worker.channel.recv()
            except (EOFError, OSError):
                raise self._died(worker.rank) from None
            self._accept(reply, grace_s)

    def _accept(self, reply: Reply, grace_s: float) -> None:
        slot = self.slot_of[reply.rank]
        if slot.index is None or reply.seq != slot.seq:
            raise RuntimeError(f"rank {reply.rank} sent reply {reply.seq}, expected {slot.seq}")
        slot.replies[reply.rank] = reply
        if not reply.ok:  # peers may now wait forever in a collective: shorten their deadline
            slot.deadline = min(slot.deadline, time.monotonic() + grace_s)
        if len(slot.replies) == len(slot.ranks):
            self._finish(slot)

    def _finish(self, slot: _Slot) -> None:
        index = slot.index
        assert index is not None
        replies = [slot.replies[rank] for rank in slot.ranks]
        slot.index = None
        if not all(reply.ok for reply in replies):
            self.failure = self.failure or self._error(replies, index, stuck=[])
            return
        self.results[index] = [pickle.loads(reply.result or b"") for reply in replies]
        worker_s = max(reply.seconds for reply in replies)
        self.stats[index] = JobStats(time.monotonic() - slot.sent_at, worker_s)

    def _silence(self, slot: _Slot, timeout_s: float) -> PoolError:
        """A slot past its deadline: an error some peers never got past, or a plain hang."""
        assert slot.index is not None
        missing = [rank for rank in slot.ranks if rank not in slot.replies]
        replies = [slot.replies[rank] for rank in slot.ranks if rank in slot.replies]
        if any(not reply.ok for reply in replies):
            return self._error(replies, slot.index, stuck=missing)
        payload = self.payloads[slot.index]
        answered = sorted(slot.replies)
        return WorkerHung(
            ranks=missing, answered=answered, timeout_s=timeout_s, job=self.job, payload=payload
        )

    def _error(self, replies: list[Reply], index: int, stuck: list[int]) -> WorkerError:
        failed = [reply for reply in replies if not reply.ok]
        return WorkerError(
            ranks=[reply.rank for reply in failed],
            job=self.job,
            payload=self.payloads[index],
            traceback=failed[0].error or "",
            stuck=stuck,
        )

    def _died(self, rank: int) -> WorkerDied:
        # None: closed its channel but lives on, exit code unknown
        exit_code = self.workers[rank].wait(timeout=5.0)
        index = self.slot_of[rank].index
        if index is None:  # an idle worker died
            return WorkerDied(rank=rank, exit_code=exit_code, job=None, payload=None)
        payload = self.payloads[index]
        return WorkerDied(rank=rank, exit_code=exit_code, job=self.job, payload=payload)
