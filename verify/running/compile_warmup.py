"""Compile the Triton kernels' specializations ahead, in parallel processes, as a GPU campaign
starts.

A compiled kernel lands in Triton's on-disk cache, which every process of this user reads: a pool
worker that meets the same specialization later loads it instead of compiling it (seconds each on
an H200, on the search's critical path). One small case per weight dtype x (aligned contiguous,
transposed, odd H) compiles the kernels' common classes (dtype, TMA or pointer loads, whether H
fills the tiles). The kernels are also specialized on the pointer loads' operand alignment, strides
and H's value class (== 1, divisible by 16, other), on V's and the d_logits chunk's divisibility
by 16 and on the merge's T, so a search meets more (168 compile keys in its first 1,100
examples, counted offline, 19 of them warmed here; docs/NIGHTLY.md): those compile as
they are met, once per host, while the concurrent searches (`concurrent_searches`) go on. The
search does not wait: it starts with the status examples.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import torch

from verify.adapters.registry import resolve
from verify.cases.spec import CaseSpec
from verify.execution.execute import LocalRank, execute

# (layout, H): TMA loads; pointer loads with H a tile multiple; pointer loads with a masked H tail.
_SHAPES = (("contiguous", 64), ("transposed", 64), ("contiguous", 33))


def warm_specs(pairs: tuple[tuple[str, str], ...]) -> list[CaseSpec]:
    """One Triton case per weight dtype of ``pairs`` (not fp64) and operand shape class."""
    weights = sorted({w for _, w in pairs if w != "fp64"})
    base = CaseSpec(tokens=3, hidden_size=8, vocab=5, backend="triton", upstream="random")
    return [
        base.with_(layout=layout, hidden_size=h, hidden_dtype=w, weight_dtype=w)
        for w in weights
        for layout, h in _SHAPES
    ]


def start(pairs: tuple[tuple[str, str], ...], processes: int | None = None) -> ProcessPoolExecutor:
    """Run `warm_specs` on ``cuda:0`` in up to ``processes`` spawned processes (default: half the
    cores); returns at once. `stop` the executor when the campaign ends."""
    specs = warm_specs(pairs)
    workers = max(1, min(len(specs), processes or (os.cpu_count() or 2) // 2))
    executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    for spec in specs:
        executor.submit(_warm, spec.to_json())
    return executor


def stop(executor: ProcessPoolExecutor) -> None:
    """Drop the cases not started yet and wait for the running ones (a few seconds at most)."""
    executor.shutdown(wait=True, cancel_futures=True)


def _warm(spec_json: str) -> str:
    spec = CaseSpec.from_json(spec_json)
    return execute(spec, LocalRank(torch.device("cuda", 0)), resolve("lce"))["status"]
