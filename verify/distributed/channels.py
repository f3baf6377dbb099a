"""Point-to-point message channels between the driver and one worker rank.

`PipeChannel` (a socket pair, local pools) and `StoreChannel` (keys in the torch.distributed store,
torchrun) carry the same messages, so `verify.distributed.worker.serve` is one loop for both.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

# An idle torchrun rank re-arms its blocking wait this often; the wait itself does not spin.
_IDLE_WAIT = timedelta(seconds=60)


def encode(message: Any) -> bytes:
    """Plain pickle: tensors travel as bytes, never through shared-memory handles."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    return pickle.loads(data)


class PipeChannel:
    """One end of a socket pair; `recv` blocks (no polling) and raises EOFError if the peer died."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, message: Any) -> None:
        self.conn.send_bytes(encode(message))

    def recv(self) -> Any:
        return decode(self.conn.recv_bytes())

    def close(self) -> None:
        self.conn.close()


class StoreChannel:
    """Messages as store keys: ``job/<rank>/<n>`` from the driver, ``reply/<rank>/<n>`` back.

    Each side numbers its own messages, so keys never repeat and need no locking.
    """

    def __init__(self, store: dist.Store, rank: int, *, driver_side: bool) -> None:
        self.store = dist.PrefixStore("lce_pool", store)
        self.rank = rank
        self.outbox = "job" if driver_side else "reply"
        self.inbox = "reply" if driver_side else "job"
        self.sent = 0
        self.received = 0

    def send(self, message: Any) -> None:
        self.store.set(f"{self.outbox}/{self.rank}/{self.sent}", encode(message))
        self.sent += 1

    def ready(self) -> bool:
        """Whether the next inbound message has arrived (never blocks)."""
        return self.store.check([self._next_key()])

    def recv(self, timeout: timedelta | None = None) -> Any:
        """Next inbound message; waits forever when ``timeout`` is None (re-arming every minute)."""
        key = self._next_key()
        while True:
            try:
                self.store.wait([key], timeout or _IDLE_WAIT)
                break
            except dist.DistStoreError:
                if timeout is not None:
                    raise TimeoutError(f"no message {key} within {timeout}") from None
        data = self.store.get(key)
        self.store.delete_key(key)
        self.received += 1
        return decode(data)

    def _next_key(self) -> str:
        return f"{self.inbox}/{self.rank}/{self.received}"
