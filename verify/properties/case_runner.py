"""`Runner`: runs a spec's job where it can run — in this process at TP=1, on a pool at TP > 1."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from verify.cases.spec import CaseSpec
from verify.properties.case import KernelRun, assemble
from verify.properties.job import JOB, LocalContext, run_case


class NeedsPool(ValueError):
    """A TP > 1 spec was given to a runner without a worker pool."""


class Runner:
    """Runs case specs, optionally with a planted bug (``mutant``, see `verify.running.mutants`).

    TP = 1 runs in this process unless ``pool_for_tp1``; TP > 1 needs ``pool`` (a
    `verify.distributed.WorkerPool`). The last few runs are cached per spec, since several
    properties start from the same run; ``fresh=True`` bypasses the cache (determinism).
    """

    def __init__(
        self,
        pool: Any | None = None,
        mutant: str | None = None,
        *,
        pool_for_tp1: bool = False,
        cache_size: int = 16,
    ) -> None:
        self.pool = pool
        self.mutant = mutant
        self.pool_for_tp1 = pool_for_tp1
        self.runs = 0  # kernel runs executed (not served from the cache)
        self._cache: OrderedDict[CaseSpec, KernelRun] = OrderedDict()
        self._cache_size = cache_size

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        """TP degrees this runner can execute."""
        return (1,) if self.pool is None else tuple(sorted({1, *self.pool.tp_sizes}))

    def run(self, spec: CaseSpec, *, fresh: bool = False) -> KernelRun:
        if not fresh and spec in self._cache:
            self._cache.move_to_end(spec)
            return self._cache[spec]
        payload = {"spec": spec.to_json(), "mutant": self.mutant}
        if spec.tp == 1 and not (self.pool_for_tp1 and self.pool is not None):
            results = [run_case(payload, LocalContext())]
        elif self.pool is None:
            raise NeedsPool(f"spec.tp={spec.tp} needs Runner(pool=WorkerPool(...)); got no pool")
        else:
            results = self.pool.run(JOB, payload, tp=spec.tp)
        self.runs += 1
        run = assemble(spec, results)
        self._cache[spec] = run
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return run
