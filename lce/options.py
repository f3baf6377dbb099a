"""The options that travel together through the public API, autograd function and backends."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

REDUCTIONS = ("none", "sum", "mean")


@dataclass(frozen=True)
class LCEOptions:
    """How to compute; see `lce.linear_cross_entropy` for each field's meaning."""

    ignore_index: int = -100
    temperature: float = 1.0
    tp_group: dist.ProcessGroup | None = None
    vocab_start: int | None = None
    reduce_grad_hidden: bool = True
    backend: str = "auto"
    chunk_size: int | None = None
