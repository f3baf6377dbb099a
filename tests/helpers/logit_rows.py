"""How many token rows' logits the torch backend computes, and where: recomputed by a GEMM
(`_logits`) or written into kept logits (`_kept_dots`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lce.backends import torch_chunked

COMPUTING = ("_logits", "_kept_dots")


@contextmanager
def logit_rows_computed() -> Iterator[dict[str, int]]:
    """Inside the block, ``{name: rows}`` counts the token rows each of `COMPUTING` computed
    (the functions restored on exit; usable in a spawned worker, without pytest's monkeypatch)."""
    rows = dict.fromkeys(COMPUTING, 0)
    originals = {name: getattr(torch_chunked, name) for name in COMPUTING}

    def counting(name: str) -> Any:
        def run(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
            rows[name] += hidden.shape[0]
            return originals[name](hidden, *args)

        return run

    try:
        for name in COMPUTING:
            setattr(torch_chunked, name, counting(name))
        yield rows
    finally:
        for name, original in originals.items():
            setattr(torch_chunked, name, original)
