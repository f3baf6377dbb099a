"""Several Hypothesis searches of one TP=1 slice at once, each in its own process and worker.

A search runs one example at a time (each draw follows from the last), and on CUDA an example is
mostly host work in small steps: Hypothesis, inputs, R and B, many small kernel launches, and a
Triton compile for every specialization it meets first. The GPU idles meanwhile, and so do most of
the host's cores. Independent searches fill them: search ``k`` draws from its own seed (`seed_of`),
runs the slice's ordinary search (`verify.running.search.SliceSearch`, the same properties and
checks) in a spawned process with its own TP=1 worker, and saves its failures' artifacts itself.
Its tally and progress calls come back over a queue and are applied here in arrival order, so the
campaign writes one report. Triton's disk cache is shared: a kernel one search compiled, the
others load. Only search 0 runs the status examples; the planned examples (landmarks, covering
rows) are dealt out, search ``k`` of ``n`` running every ``n``-th from the ``k``-th, so the plan
is done ``n`` times sooner rather than run ``n`` times over (each search ran all of it, and a
failing landmark was found and listed by every search). Each search keeps its own record of the
failure classes it saved, so a class two searches both find in their random phases is saved by
each.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from verify.adapters.interface import Adapter
from verify.adapters.registry import resolve
from verify.distributed.pool import WorkerPool
from verify.distributed.seam import CASE_MODULES
from verify.running import stopping
from verify.running.config import CampaignConfig
from verify.running.search import SliceSearch, slice_row

# How long a search may take to save its findings and stop after SIGTERM (its pool's grace and a
# shrink step in flight), before it is killed. Also the campaign's backstop: a search still
# without its "done" this long after the budget's deadline plus `campaign.OVERRUN_GRACE_S` (when
# its own watchdog should have stopped it) is killed.
STOP_GRACE_S = 30.0
# How long the search processes get to exit once the slice is over.
EXIT_S = 10.0
# A search process found dead without its "done" message is given this long for messages still in
# the queue's pipe before it counts as died.
DRAIN_S = 2.0


def seed_of(seed: int | None, index: int, stride: int) -> int | None:
    """Search ``index``'s first seed: the campaign's for search 0 (one search is the plain slice),
    then ``stride`` apart, so no search's restarts (``seed + 1``, ...) repeat another's seeds."""
    return seed if index == 0 else (seed or 0) + index * stride


@dataclass(frozen=True)
class _Order:
    """What one search process runs (picklable)."""

    config: CampaignConfig  # its seed this search's
    impl: str  # the adapter's ref (adapters hold functions: the search process resolves it)
    names: tuple[str, ...]
    backend: str
    tp: int
    index: int
    count: int  # the slice's searches: this one runs every count-th planned example
    deadlines: tuple[float, float]  # time.monotonic(): one clock for every process on the host
    explicit_until: float | None  # the planned examples' end (`SliceSearch.explicit_until`)
    with_status: bool
    threads: int  # torch CPU threads of the search's driver and of its worker


class _Forward:
    """Stands in for the campaign's tally or progress in a search process: each method call is
    sent to the campaign process as ``(target, method, (args, kwargs))``."""

    def __init__(self, events: Any, target: str) -> None:
        self._events, self._target = events, target

    def __getattr__(self, method: str) -> Any:
        return lambda *args, **kwargs: self._events.put((self._target, method, (args, kwargs)))


class ConcurrentSlice:
    """One backend x TP slice searched by ``count`` processes at once; used like a
    `SliceSearch` (``deadlines``, `run`, ``status``, ``artifacts``, `row`, `save_unsaved`)."""

    def __init__(
        self,
        config: CampaignConfig,
        adapter: Adapter,
        backend: str,
        tp: int,
        names: tuple[str, ...],
        tally: Any,
        progress: Any,
        *,
        count: int,
        seed_stride: int,
    ) -> None:
        self.config, self.adapter, self.backend, self.tp = config, adapter, backend, tp
        self.names = names
        self.where = f"{adapter.label(backend)} TP={tp}"
        self.tally, self.progress = tally, progress
        self.count, self.seed_stride = count, seed_stride
        self.deadlines = (math.inf, math.inf)
        self.explicit_until: float | None = None
        self.status, self.examples, self.seconds = "done", 0, 0.0
        self.artifacts: list[Path] = []
        self._statuses: list[str] = []
        self._ended: set[int] = set()  # searches that reported their end (or died)

    def row(self) -> dict[str, Any]:
        return slice_row(self.where, self.status, self.examples, self.artifacts, self.seconds)

    def save_unsaved(self) -> None:
        """Nothing to do here: each search saves its own unsaved failure when it is stopped."""

    def run(self, pool: Any, with_status: bool) -> None:
        """Run the searches until each has ended (``pool`` is unused: each opens its own)."""
        context = multiprocessing.get_context("spawn")
        events = context.Queue()
        threads = max(1, (os.cpu_count() or 2) // (2 * self.count))
        processes = []
        for index in range(self.count):
            config = replace(self.config, seed=seed_of(self.config.seed, index, self.seed_stride))
            order = _Order(
                config, self.adapter.ref, self.names, self.backend, self.tp, index, self.count,
                self.deadlines, self.explicit_until, with_status and index == 0, threads,
            )  # fmt: skip
            processes.append(context.Process(target=_search, args=(order, events)))
        began = time.monotonic()
        try:
            for process in processes:
                process.start()
            floor = self.config.example_deadline().seconds()
            late = self.deadlines[1] + floor + stopping.OVERRUN_GRACE_S + STOP_GRACE_S
            self._collect(processes, events, until=late)
            self._kill_late(processes)
        except KeyboardInterrupt:  # stop the searches; each saves what it found, then reports
            for process in processes:
                if process.pid is not None and process.is_alive():
                    os.kill(process.pid, signal.SIGTERM)
            self._collect(processes, events, until=time.monotonic() + STOP_GRACE_S)
            raise
        finally:  # a search that reported its end exits at once; one that did not is ended
            exit_by = time.monotonic() + EXIT_S
            for process in processes:
                if process.pid is not None:
                    process.join(timeout=max(0.0, exit_by - time.monotonic()))
                    if process.is_alive():
                        process.kill()
                        process.join()
            self.seconds = time.monotonic() - began
            self.status = _merged_status(self._statuses)

    def _collect(self, processes: list[Any], events: Any, until: float = math.inf) -> None:
        """Apply the searches' events until each has reported its end (or died, or ``until``)."""
        pending = set(range(len(processes))) - self._ended
        missing_since: dict[int, float] = {}
        while pending and time.monotonic() < until:
            try:
                event = events.get(timeout=0.5)
            except queue.Empty:
                now = time.monotonic()
                for index in sorted(pending):
                    process = processes[index]
                    dead = process.pid is not None and not process.is_alive()
                    if dead and now - missing_since.setdefault(index, now) >= DRAIN_S:
                        self._died(index, process.exitcode)
                        pending.discard(index)
                continue
            target, method, (args, kwargs) = event
            if target == "done":
                pending.discard(self._done(*args))
            else:
                if target == "tally" and method == "add_example":  # counted as they arrive:
                    self.examples += 1  # a search killed before its "done" still counts
                getattr(self.tally if target == "tally" else self.progress, method)(*args, **kwargs)

    def _kill_late(self, processes: list[Any]) -> None:
        """Kill the searches that have not reported by now (past the budget and its graces):
        each is an overrun, its unsaved failure lost (its watchdog's stop did not save it)."""
        for index, process in enumerate(processes):
            if index in self._ended:
                continue
            if process.pid is not None and process.is_alive():
                process.kill()
            self.tally.add_error(
                self.where,
                f"search {index} of {self.count} still ran past the budget and its stop's grace: "
                "killed (its examples counted; a failure it had not saved is lost)",
            )
            self._done(index, "overrun", [])

    def _done(self, index: int, status: str, artifacts: list[str]) -> int:
        self._ended.add(index)
        self._statuses.append(status)
        self.artifacts.extend(Path(path) for path in artifacts)
        return index

    def _died(self, index: int, exitcode: int | None) -> None:
        self.tally.add_error(
            self.where,
            f"search {index} of {self.count} ended without reporting (exit code {exitcode})",
        )
        self._done(index, "infrastructure error", [])


def _merged_status(statuses: list[str]) -> str:
    """The slice's status: the most serious of its searches'."""
    for status in ("interrupted", "overrun", "infrastructure error", "budget"):
        if status in statuses:
            return status
    return "done"


def _search(order: _Order, events: Any) -> None:
    """A search process: the slice's search at ``order``'s seed, its pool its own."""
    torch.set_num_threads(order.threads)
    tally = _Forward(events, "tally")
    search = SliceSearch(
        order.config, resolve(order.impl), order.backend, order.tp, order.names, tally,
        _Forward(events, "progress"), part=(order.index, order.count),
    )  # fmt: skip
    search.deadlines, search.explicit_until = order.deadlines, order.explicit_until
    pool = None
    with stopping.stop_signals():
        try:
            pool = WorkerPool(
                world_size=order.tp, device=order.config.device,
                threads_per_worker=order.threads, preload=CASE_MODULES,
            )  # fmt: skip
            search.run(pool, with_status=order.with_status)
        except KeyboardInterrupt:  # SIGTERM from the campaign, or its own overrun watchdog
            search.status = "overrun" if stopping.overrun_stopped() else "interrupted"
            search.save_unsaved()
        except Exception as exc:  # the search could not go on: an infrastructure error
            last = traceback.format_exception_only(exc)[-1].strip()
            tally.add_error(search.where, f"search {order.index}: {last}")
            search.status = "infrastructure error"
        finally:
            if pool is not None:
                with contextlib.suppress(Exception):
                    pool.close()
            paths = [str(path) for path in search.artifacts]
            if search.status == "overrun":
                stacks = stopping.stacks_file(order.config.out_dir)
                tally.add_error(
                    search.where, f"search {order.index}: {stopping.overrun_error(stacks)}"
                )
            events.put(("done", "", ((order.index, search.status, paths), {})))
