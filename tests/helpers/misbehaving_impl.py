"""Implementations that misbehave the way GPU kernels do, on one shape class (an empty batch, as a
kernel launched on a grid of zero blocks may): one hangs (a rank that never returns, its peers
left in a collective), one kills its process (`os.abort`, standing in for a segfault or an illegal
memory access). Otherwise they are lce's torch backend, vocab-parallel, so a campaign searches
them at TP 1 and 2. The landmark specs (the first examples of every search) all have tokens:
the generator's first examples meet the trigger, so the finding comes early and shrinks fast."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace

from verify.adapters.builtin import lce_adapter
from verify.adapters.interface import Adapter, Call


def _misbehaving(name: str, act: Callable[[], None]) -> Adapter:
    base = lce_adapter(("torch",))
    tokens, loss = base.token_outputs, base.loss
    assert tokens is not None and loss is not None

    def check(call: Call) -> None:
        if call.targets.numel() == 0:
            rank = 0 if call.tp_group is None else call.tp_group.rank()
            if rank == 0:
                act()

    def token_outputs(call: Call):
        check(call)
        return tokens(call)

    def scalar_loss(call: Call, reduction: str):
        check(call)
        return loss(call, reduction)

    return replace(
        base, name=name, token_outputs=token_outputs, loss=scalar_loss,
        description=f"lce's torch backend, but {name} on an empty batch",
    )  # fmt: skip


def hangs() -> Adapter:
    """Sleeps (for an hour) on an empty batch: a hang."""
    return _misbehaving("hangs", lambda: time.sleep(3600))


def aborts() -> Adapter:
    """Aborts its process on an empty batch: a crash (SIGABRT)."""
    return _misbehaving("aborts", os.abort)
