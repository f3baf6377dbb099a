"""Route the engine's runs to an adapter through the seam every property already uses: the pool.

`Runner` sends each case to ``pool.run(JOB, payload, tp)``; `ImplPool` answers the engine's case job
with the adapter (in this process at TP = 1, on the wrapped worker pool at TP > 1) and passes any
other job (the megatron peer) to the wrapped pool. `adapter_runner` builds such a `Runner`.
"""

from __future__ import annotations

from typing import Any

from verify.adapters.execute import ADAPTER_JOB, execute_payload
from verify.adapters.interface import Adapter
from verify.properties.case_runner import NeedsPool, Runner
from verify.properties.job import JOB, LocalContext


class ImplPool:
    """Pool-shaped: ``run(job, payload, tp)`` and ``tp_sizes``, backed by ``adapter`` and ``inner``
    (a `verify.distributed.WorkerPool` or None). TP > 1 needs ``inner`` and an adapter that claims
    tensor parallelism; its ``ref`` must resolve in the workers."""

    def __init__(self, adapter: Adapter, inner: Any | None = None) -> None:
        self.adapter = adapter
        self.inner = inner

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        if self.inner is None or not self.adapter.capabilities.tensor_parallel:
            return (1,)
        return tuple(sorted({1, *self.inner.tp_sizes}))

    def run(self, job: str, payload: dict[str, Any], tp: int, **kwargs: Any) -> list[Any]:
        if job == JOB and tp == 1:
            return [execute_payload(payload, LocalContext(), self.adapter)]
        if self.inner is None:
            raise NeedsPool(f"TP={tp} (job {job}) needs a worker pool: pass pool=WorkerPool(...)")
        if job == JOB:
            if not self.adapter.ref:
                raise ValueError(f"adapter {self.adapter.name!r} has no ref for the workers")
            return self.inner.run(ADAPTER_JOB, {**payload, "impl": self.adapter.ref}, tp, **kwargs)
        return self.inner.run(job, payload, tp, **kwargs)


def adapter_runner(adapter: Adapter, pool: Any | None = None, mutant: str | None = None) -> Runner:
    """A `Runner` whose every case runs ``adapter`` (TP > 1 on ``pool``)."""
    return Runner(ImplPool(adapter, pool), mutant, pool_for_tp1=True)
