"""A campaign: one implementation's backends x TP degrees, each slice searched under a settings
profile, within a time budget, into one report.

Whether the implementation is lce or another (``--impl``, the pytest plugin), the campaign is the
same: its properties are those that apply to what its adapter claims (the rest listed as not
tested), each slice (`verify.running.search.SliceSearch`) runs its cases on worker processes (TP =
1 included), and the report (JSON, Markdown, PNG) goes to ``out_dir`` with one schema and one
exit-code rule. On CUDA a TP = 1 slice runs several searches at once
(`verify.running.concurrent_searches`).
"""

from __future__ import annotations

import secrets
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from verify.adapters.features import Untested, unclaimed
from verify.adapters.interface import Adapter
from verify.adapters.registry import resolve
from verify.cases.spec import EXTENTS
from verify.distributed.pool import WorkerPool
from verify.distributed.seam import CASE_MODULES, Pool
from verify.execution.deadline import FACTOR
from verify.properties.catalog import applicable
from verify.properties.status import available_backends
from verify.results import artifacts, report
from verify.running import compile_warmup, concurrent_searches, stopping
from verify.running.config import CampaignConfig
from verify.running.profiles import profile_settings
from verify.running.progress import Progress
from verify.running.search import RESTARTS, SliceSearch, slice_row


@dataclass
class CampaignResult:
    passed: bool
    report: dict[str, Any]
    paths: dict[str, Path | None]
    artifacts: list[Path] = field(default_factory=list)
    interrupted: str | None = None  # the signal that stopped it (SIGINT, SIGTERM)


@dataclass(frozen=True)
class Plan:
    """What a campaign of ``adapter`` runs here: its slices and properties, and what it leaves
    untested (with the reason)."""

    adapter: Adapter
    slices: tuple[tuple[str, int], ...]
    properties: tuple[str, ...]
    untested: tuple[Untested, ...]


def plan(config: CampaignConfig) -> Plan:
    """The slices (backend, TP) and properties of ``config``'s implementation; raises ValueError
    naming what is missing when nothing can run here."""
    adapter = resolve(config.impl)
    if not adapter.ref:
        raise ValueError(
            f"{adapter.name}: workers find an implementation by its ref; pass a built-in name or "
            "'module:function' as impl, not an Adapter object"
        )
    runnable = [b for b in adapter.capabilities.backends if b in available_backends(config.device)]
    backends = [b for b in runnable if not config.backends or b in config.backends]
    if not backends:
        raise ValueError(
            f"{adapter.name}: none of its backends {adapter.capabilities.backends} runs here"
            f"{' among --backends ' + ','.join(config.backends) if config.backends else ''} "
            "(triton needs CUDA or TRITON_INTERPRET=1)"
        )
    tps = tuple(t for t in config.tp_sizes if t == 1 or adapter.capabilities.tensor_parallel)
    tps = tps or (1,)
    names, gaps = applicable(adapter, tps, config.properties, config.device)
    untested = (*unclaimed(adapter, tps), *gaps, *_slow_extents(config, adapter, backends))
    return Plan(adapter, tuple((b, t) for b in backends for t in tps), names, untested)


def _slow_extents(config: CampaignConfig, adapter: Adapter, backends: list[str]) -> list[Untested]:
    """The extents a backend's slices leave out here (`CampaignConfig.extents_at`)."""
    return [
        Untested(
            f"{adapter.label(backend)}: extents {', '.join(e for e in EXTENTS if e not in kept)}",
            "too slow in the Triton interpreter (a wide case's run takes seconds); a GPU "
            "campaign runs them",
        )
        for backend in backends
        if len(kept := config.extents_at(backend)) < len(EXTENTS)
    ]


def run_campaign(
    config: CampaignConfig, progress: Progress | None = None, pool: Pool | None = None
) -> CampaignResult:
    """Run each slice of ``config`` and write the report; a failure does not raise.

    Every slice runs its cases on ``pool`` when given (left open), else on a pool made and closed
    here (the concurrent searches of a CUDA TP = 1 slice open their own).
    """
    config.validate()
    if config.seed is None and not profile_settings(config.profile).derandomize:
        # A random profile still draws from a recorded seed: the report's seed repeats the
        # search (`--seed`), and Hypothesis prints no seed of its own when the budget stops it.
        config = replace(config, seed=secrets.randbits(64))
    chosen = plan(config)
    progress = progress or Progress(config.profile, config.budget_s, stream=sys.stderr)
    tally = report.Tally()
    began = time.monotonic()
    runs = _SliceRuns(config, chosen, tally, progress, pool, began + config.budget_s)
    with stopping.stop_signals() as received:
        try:
            runs.run_all()
        except KeyboardInterrupt:  # SIGINT, or SIGTERM through `stop_signals`
            runs.interrupted(received.name)
        finally:
            runs.close()
            progress.finish(runs.stopped_by)
        meta = _meta(config, chosen, time.monotonic() - began, runs)
        document, paths = report.write(tally, meta, config.out_dir)
    return CampaignResult(document["passed"], document, paths, runs.saved, runs.stopped_by)


# A slice searches for an equal share of the time left (time a slice leaves over flows to the
# later ones). Its planned examples (landmarks, covering rows: what the coverage table counts) may
# run past that share while every later slice keeps this fraction of the equal share it had at
# the start: a slice whose plan costs more than a share (the torch backend's TP = 4 slice on 2
# cores: 19 landmarks and ~70 rows, a compile per row) reaches all its pairs, and a later slice
# (the Triton interpreter's) still runs its landmarks. What a plan did not reach is reported as
# not reached in budget (the verdict counts failures only).
KEPT_SHARE = 0.5


class _SliceRuns:
    """The slices of one campaign, run in turn, each with its share of the budget left."""

    def __init__(self, config, chosen: Plan, tally, progress, pool: Pool | None, deadline: float):
        self.config, self.plan, self.tally, self.progress = config, chosen, tally, progress
        self.given = pool
        self.pools: dict[int, WorkerPool] = {}  # the pools made here, by TP degree
        self.deadline = deadline
        self.saved: list[Path] = []
        self.exhausted = False
        self.stopped_by: str | None = None
        self.search: Any = None  # the slice running now
        self.warmup = None
        if config.on_gpu and "triton" in {b for b, _ in chosen.slices}:
            self.warmup = compile_warmup.start(config.dtype_pairs)

    def run_all(self) -> None:
        slices = self.plan.slices
        first_backend = slices[0][0]
        floor = KEPT_SHARE * (self.deadline - time.monotonic()) / len(slices)
        for index, (backend, tp) in enumerate(slices):
            now = time.monotonic()
            remaining = self.deadline - now
            if remaining <= 0:
                self.exhausted = True
                self.tally.slices.append(self._row(backend, tp, "skipped (budget)"))
                continue
            later = len(slices) - index - 1
            self.progress.start_slice(self.plan.adapter.label(backend), tp)
            self.search = self._slice(backend, tp)
            share_end = now + remaining / (later + 1)
            self.search.deadlines = (share_end, self.deadline)
            self.search.explicit_until = max(share_end, self.deadline - floor * later)
            self._run_slice(with_status=backend == first_backend)
            self.search = None

    def _slice(self, backend: str, tp: int) -> Any:
        count = self.config.searches_at(tp)
        args = (self.config, self.plan.adapter, backend, tp, self.plan.properties)
        if count == 1:
            return SliceSearch(*args, self.tally, self.progress)
        return concurrent_searches.ConcurrentSlice(
            *args, self.tally, self.progress, count=count, seed_stride=1 + RESTARTS
        )

    def _run_slice(self, with_status: bool) -> None:
        search = self.search
        try:
            concurrent = isinstance(search, concurrent_searches.ConcurrentSlice)
            pool = None if concurrent else self._pool(search.tp)
            search.run(pool, with_status=with_status)
            if stopping.stop_requested():  # the interrupt was swallowed on its way up
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            if not stopping.overrun_stopped():
                raise
            search.status = "overrun"  # the search's own watchdog stopped it
            search.save_unsaved()
            stacks = stopping.stacks_file(self.config.out_dir)
            self.tally.add_error(search.where, stopping.overrun_error(stacks))
        self.exhausted |= search.status in ("budget", "overrun")
        self.saved.extend(search.artifacts)
        self.tally.slices.append(search.row())

    def _pool(self, tp: int) -> Pool:
        """The given pool, else one of ``tp`` workers (kept for the next slice at ``tp``): a
        slice's faults restart only its own ranks' workers."""
        if self.given is not None:
            return self.given
        if tp not in self.pools:
            device = self.config.device
            self.pools[tp] = WorkerPool(world_size=tp, device=device, preload=CASE_MODULES)
        return self.pools[tp]

    def interrupted(self, signal_name: str) -> None:
        """Record the slice a stop signal ended (its examples, any unsaved failure) and the
        slices it left unrun."""
        self.stopped_by = signal_name
        if self.search is not None:
            self.search.status = "interrupted"
            self.search.save_unsaved()
            self.saved.extend(self.search.artifacts)
            self.tally.slices.append(self.search.row())
        for backend, tp in self.plan.slices[len(self.tally.slices) :]:
            self.tally.slices.append(self._row(backend, tp, "not run (interrupted)"))

    def _row(self, backend: str, tp: int, status: str) -> dict[str, Any]:
        return slice_row(f"{self.plan.adapter.label(backend)} TP={tp}", status, 0, [], 0.0)

    def close(self) -> None:
        if self.warmup is not None:
            compile_warmup.stop(self.warmup)
        for pool in self.pools.values():
            pool.close()


def _deadline_rule(config: CampaignConfig) -> str:
    deadline = config.example_deadline()
    if deadline.fixed:
        return f"{deadline.floor_s:g} s (fixed)"
    return f"max({deadline.floor_s:g} s, {FACTOR:g} x the slowest example)"


def _meta(config: CampaignConfig, chosen: Plan, wall_s: float, runs: _SliceRuns) -> dict:
    adapter = chosen.adapter
    return {
        "title": f"{config.profile} campaign of {adapter.name}",
        "interrupted": runs.stopped_by,
        "profile": config.profile,
        "implementation": report.implementation_record(adapter),
        "backends": sorted({b for b, _ in chosen.slices}),
        "tp_sizes": sorted({t for _, t in chosen.slices}),
        "properties": list(chosen.properties),
        "not_tested": [{"what": u.what, "reason": u.reason} for u in chosen.untested],
        "out_dir": str(config.out_dir),
        "budget_s": config.budget_s,
        "budget_exhausted": runs.exhausted,
        "example_deadline": _deadline_rule(config),
        "wall_s": round(wall_s, 2),
        "seed": config.seed,
        "mutant": config.mutant,
        "dtypes": list(config.dtypes) or None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - wall_s)),
        "environment": {
            "versions": artifacts.versions(),
            "device": artifacts.device_description(config.device),
        },
    }
