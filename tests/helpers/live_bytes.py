"""The peak of live tensor storage a block of code allocates (CPU or GPU), op by op."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Inside ``with LiveBytes() as live:``, ``live.peak`` is the most bytes of storage that ops
    run in the block had allocated and not yet freed at once (tensors made before the block, and
    views, count nothing). ``live.peak_op`` names the op that set the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.peak_op = ""
        self._storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor.untyped_storage(), str(func))
        return out

    def _track(self, storage: torch.UntypedStorage, op: str) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._storages:
            return
        self._storages.add(key)
        self.live += size
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, op
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._storages.discard(key)
