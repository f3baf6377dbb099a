"""`Runner`: runs a spec's case through one adapter, in this process or on a pool's TP group."""

from __future__ import annotations

from collections import OrderedDict

import torch

from verify.cases.spec import CaseSpec
from verify.distributed.seam import Pool, needs_pool
from verify.execution import execute
from verify.execution.interface import Adapter
from verify.execution.outcome import KernelRun, assemble
from verify.execution.selection import resolve
from verify.running import stage_timing

# Note added to an exception raised while running a case (the implementation, its job, the pool),
# so `case_of` tells it from one raised by a property's own code.
RUNNING_NOTE = "raised while running the case "


class NeedsPool(ValueError):
    """A TP > 1 spec was given to a runner without a worker pool."""


def case_of(exc: BaseException) -> CaseSpec | None:
    """The spec whose run raised ``exc`` (the first leaf's, for a group); None when ``exc`` did
    not come out of `Runner.run` (e.g. a property's own code raised it)."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    for note in getattr(exc, "__notes__", ()):
        if note.startswith(RUNNING_NOTE):
            return CaseSpec.from_json(note.removeprefix(RUNNING_NOTE))
    return None


class Runner:
    """Runs case specs on ``adapter`` (default: lce), optionally with a planted bug (``mutant``,
    see `verify.running.mutants`).

    A case runs on ``pool`` when `verify.distributed.seam.needs_pool` says so for its TP degree
    and the pool's device, else in this process; TP > 1 without a pool raises `NeedsPool`. The
    last few runs are cached per spec, since several properties start from the same run;
    ``fresh=True`` bypasses the cache (determinism).
    """

    def __init__(
        self,
        pool: Pool | None = None,
        mutant: str | None = None,
        *,
        adapter: Adapter | None = None,
        cache_size: int = 16,
    ) -> None:
        self.pool = pool
        self.mutant = mutant
        self.adapter = adapter or resolve("lce")
        self.runs = 0  # kernel runs executed (not served from the cache)
        self._cache: OrderedDict[CaseSpec, KernelRun] = OrderedDict()
        self._cache_size = cache_size

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        """TP degrees this runner can execute."""
        if self.pool is None or not self.adapter.capabilities.tensor_parallel:
            return (1,)
        return tuple(sorted({1, *self.pool.tp_sizes}))

    def offloads(self, spec: CaseSpec) -> bool:
        """Whether ``spec`` runs on a GPU worker, leaving this process's CPU idle meanwhile."""
        return self.pool is not None and self.pool.device == "cuda" and needs_pool(spec.tp, "cuda")

    def run(self, spec: CaseSpec, *, fresh: bool = False) -> KernelRun:
        if not fresh and spec in self._cache:
            self._cache.move_to_end(spec)
            return self._cache[spec]
        try:
            results = self._execute(spec)
        except Exception as exc:
            if case_of(exc) is None:
                exc.add_note(RUNNING_NOTE + spec.to_json())
            raise
        self.runs += 1
        run = assemble(spec, results)
        self._cache[spec] = run
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return run

    def _execute(self, spec: CaseSpec) -> list[dict]:
        """Every rank's result for ``spec``."""
        payload = execute.case_payload(spec, self.adapter.ref, self.mutant)
        on_pool = self.pool is not None and needs_pool(spec.tp, self.pool.device)
        if on_pool and not self.adapter.ref:
            raise ValueError(f"adapter {self.adapter.name!r} has no ref for the workers")
        if not on_pool and spec.tp > 1:
            raise NeedsPool(f"spec.tp={spec.tp} needs Runner(pool=WorkerPool(...)); got no pool")
        with stage_timing.stage("dispatch"):  # less the job's own stages, added below
            if on_pool:
                # Read at call time: tests swap in a job whose ranks die.
                results = self.pool.run(execute.CASE_JOB, payload, tp=spec.tp)
            else:
                local = execute.LocalRank(torch.device(self.adapter.device))
                results = [execute.run_payload(payload, local, self.adapter)]
            if "timing" in results[0]:  # rank 0's stages (a test's job may send none)
                stage_timing.current().add_taken(results[0]["timing"])
        return results
