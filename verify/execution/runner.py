"""`Runner`: runs a spec's case through one adapter on a pool's TP group, and turns a worker that
dies or stops answering into either an infrastructure error or a finding of the implementation.

A campaign's runner always has a pool: the implementation under test never runs in the driver,
at TP = 1 too, so a kernel that segfaults, aborts or hangs takes down a worker, not the harness.
A case whose worker dies or hangs is rerun once on a fresh worker (after a hang, with a longer
deadline: `ExampleDeadline.rerun_seconds`): failing so again is the implementation's
`ImplementationFault` (kind ``crash`` or ``hang``), which the properties report as a failing
verdict that Hypothesis shrinks like any other; a rerun that passes makes the first fault the
machine's (``on_fault``). A runner without a pool runs the case in this process (the
library API and the tests of the properties).
"""

from __future__ import annotations

import importlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from verify.adapters.interface import Adapter
from verify.adapters.registry import resolve
from verify.cases.spec import CaseSpec
from verify.distributed.errors import PoolError, WorkerDied, WorkerError, WorkerHung, exit_text
from verify.distributed.seam import Pool
from verify.execution import execute, stage_timing
from verify.execution.deadline import BudgetExhausted, ExampleDeadline
from verify.execution.outcome import KernelRun, assemble

# Note added to an exception raised while running a case (the implementation, its job, the pool),
# so `case_of` tells it from one raised by a property's own code.
RUNNING_NOTE = "raised while running the case "


class NeedsPool(ValueError):
    """A TP > 1 spec was given to a runner without a worker pool."""


class ImplementationFault(Exception):
    """The implementation crashed (``kind="crash"``: its process died, by a signal, an exit code
    or a fatal device error) or hung (``kind="hang"``: no answer within the per-example
    deadline) on ``spec``, on a fresh worker again (confirmed)."""

    def __init__(self, kind: str, detail: str, spec: CaseSpec) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.spec = kind, detail, spec


class CaseRaised(Exception):
    """The case's job raised in a worker (not a refusal the adapter declares): the message is the
    worker's ``Type: message`` line, its traceback the exception's note."""

    def __init__(self, error: WorkerError) -> None:
        lines = error.traceback.strip().splitlines()
        super().__init__(lines[-1] if lines else str(error).splitlines()[0])
        self.add_note(f"traceback from rank {error.rank}:\n{error.traceback}")


def error_line(exc: BaseException) -> str:
    """``Type: first line`` of ``exc`` (a worker's own line for `CaseRaised`)."""
    if isinstance(exc, CaseRaised):
        return str(exc)
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"


class InfraFault(BaseException):
    """The workers could not run a case twice for reasons that are not the implementation's (a
    pool that cannot start): stop the search without shrinking (a BaseException, so Hypothesis
    does not take it for the case's failure)."""

    def __init__(self, error: PoolError, spec: CaseSpec) -> None:
        super().__init__(str(error))
        self.error, self.spec = error, spec


def case_of(exc: BaseException) -> CaseSpec | None:
    """The spec whose run raised ``exc`` (the first leaf's, for a group); None when ``exc`` did
    not come out of `Runner.run` (e.g. a property's own code raised it)."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    if isinstance(exc, ImplementationFault):
        return exc.spec
    for note in getattr(exc, "__notes__", ()):
        if note.startswith(RUNNING_NOTE):
            return CaseSpec.from_json(note.removeprefix(RUNNING_NOTE))
    return None


@dataclass(frozen=True)
class Fault:
    """What a failed attempt at a case says: ``kind`` crash or hang, or None for a fault that is
    never the implementation's (the pool could not start)."""

    kind: str | None
    detail: str


def classify(error: PoolError, deadline_s: float) -> Fault:
    """The `Fault` of a pool error raised while running a case."""
    first = str(error).splitlines()[0]
    if isinstance(error, WorkerDied):
        if error.job is None:
            return Fault(None, first)
        return Fault(
            "crash", f"the process of rank {error.rank} died ({exit_text(error.exit_code)})"
        )
    if isinstance(error, WorkerHung):
        if error.job is None:
            return Fault(None, first)
        return Fault("hang", f"no answer within {deadline_s:.3g} s")
    fatal = (*execute.FATAL_DEVICE_ERRORS, "AcceleratorError")
    if isinstance(error, WorkerError) and any(text in error.traceback for text in fatal):
        last = error.traceback.strip().splitlines()[-1]
        return Fault("crash", f"fatal device error on rank {error.rank}: {last}")
    if isinstance(error, WorkerError) and not error.pool_intact:
        return Fault("hang", f"{first.split(' ---')[0]} (the other ranks never finished)")
    return Fault(None, first)


class Runner:
    """Runs case specs on ``adapter`` (default: lce), optionally with a planted bug (``mutant``,
    see `verify.execution.mutants`).

    With a ``pool`` every case runs there, within ``deadline``'s per-example seconds (a dead or
    hung worker is rerun once, see the module); without one, in this process (TP > 1 then raises
    `NeedsPool`). ``on_fault(message)`` hears of faults the rerun showed to be the machine's;
    ``stop_at`` (``time.monotonic()``) is the search's end: a fault past it is not rerun (the
    search stops, `BudgetExhausted`). The last few runs are cached per spec, since several
    properties start from the same run; ``fresh=True`` bypasses the cache (determinism).
    """

    def __init__(
        self,
        pool: Pool | None = None,
        mutant: str | None = None,
        *,
        adapter: Adapter | None = None,
        cache_size: int = 16,
        deadline: ExampleDeadline | None = None,
        on_fault: Callable[[str], None] | None = None,
    ) -> None:
        self.pool = pool
        self.mutant = mutant
        self.adapter = adapter or resolve("lce")
        self.deadline = deadline or ExampleDeadline()
        self.on_fault = on_fault or (lambda message: None)
        self.stop_at = float("inf")
        self.confirmed: set[str] = set()  # fault kinds confirmed in this search (`new_search`)
        self.fault_deadline_s: float | None = None  # the deadline of the last fault confirmed
        self.runs = 0  # kernel runs executed (not served from the cache)
        self._cache: OrderedDict[CaseSpec, KernelRun] = OrderedDict()
        self._cache_size = cache_size

    @property
    def device(self) -> str:
        """Where this runner's runs go: its pool's device, else the adapter's (this process)."""
        return self.pool.device if self.pool is not None else self.adapter.device

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        """TP degrees this runner can execute."""
        if self.pool is None or not self.adapter.capabilities.tensor_parallel:
            return (1,)
        return tuple(sorted({1, *self.pool.tp_sizes}))

    @property
    def bitwise_reruns(self) -> bool:
        """The implementation claims bit-identical reruns, so two runs that should agree exactly
        must. One that does not (CCE's atomic adds: the same spec rerun differed by 9.5e-6 on
        the H100 of 2026-12-06) is held to the dtype's tolerance for two runs instead, and its
        second backward is judged against R alone."""
        return self.adapter.capabilities.deterministic

    @property
    def offloads(self) -> bool:
        """Cases run on workers, leaving this process free for R and B meanwhile."""
        return self.pool is not None

    def new_search(self, stop_at: float = float("inf")) -> None:
        """A new search begins: its end, and no fault confirmed yet."""
        self.stop_at, self.confirmed = stop_at, set()

    def run(self, spec: CaseSpec, *, fresh: bool = False) -> KernelRun:
        if not fresh and spec in self._cache:
            self._cache.move_to_end(spec)
            return self._cache[spec]
        try:
            results = self._execute(spec)
        except ImplementationFault:
            raise
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

        def here() -> list[dict]:
            local = execute.LocalRank(torch.device(self.device))
            return [execute.run_payload(payload, local, self.adapter)]

        with stage_timing.stage("dispatch"):  # less the job's own stages, added below
            # CASE_JOB read at call time: tests swap in a job whose ranks die.
            results = self.run_job(execute.CASE_JOB, payload, spec, here)
            if "timing" in results[0]:  # rank 0's stages (a test's job may send none)
                stage_timing.current().add_taken(results[0]["timing"])
        return results

    def run_job(
        self, job: str, payload: dict, spec: CaseSpec, here: Callable[[], list[Any]]
    ) -> list[Any]:
        """``job`` (``"module:function"``) on ``payload`` on the ranks of ``spec.tp``: on the pool
        with its faults judged as a case's (the module), or ``here()`` without one."""
        if self.pool is None:
            if spec.tp > 1:
                raise NeedsPool(f"spec.tp={spec.tp} needs Runner(pool=WorkerPool(...)); no pool")
            return here()
        if not self.adapter.ref:
            raise ValueError(f"adapter {self.adapter.name!r} has no ref for the workers")
        return self._on_pool(job, payload, spec)

    def run_check(self, check: str, spec: CaseSpec) -> Any:
        """``check(spec, adapter, mutant, rank)`` (``"module:function"``) on one rank: a worker's
        when there is a pool (`check_job`), this process's otherwise; its result."""
        payload = {"check": check, "spec": spec.to_json(), "impl": self.adapter.ref}
        payload["mutant"] = self.mutant

        def here() -> list[Any]:
            local = execute.LocalRank(torch.device(self.device))
            return [_named(check)(spec, self.adapter, self.mutant, local)]

        return self.run_job(CHECK_JOB, payload, spec, here)[0]

    def _on_pool(self, job: str, payload: dict, spec: CaseSpec) -> list[Any]:
        """``job`` on the pool: a first fault is rerun once on fresh workers (see the module)."""
        assert self.pool is not None
        first: Fault | None = None
        for attempt in (1, 2):
            seconds = self._attempt_seconds(first)
            began = time.monotonic()
            try:
                results = self.pool.run(job, payload, tp=spec.tp, timeout_s=seconds)
            except PoolError as error:
                fault = classify(error, seconds)
                if isinstance(error, WorkerError) and error.pool_intact and fault.kind is None:
                    raise CaseRaised(error) from error  # the case's outcome, not a fault
                reset = getattr(self.pool, "reset", None)
                if reset is not None:
                    reset()  # a crashed device context or a stuck collective: fresh workers
                first = self._after_fault(spec, fault, first, attempt, error)
                continue
            stats = getattr(self.pool, "last_stats", None)  # the job's own time, not the pipes'
            self.deadline.observe(stats[0].worker_s if stats else time.monotonic() - began)
            if first is not None:
                self.on_fault(f"{first.detail}; the rerun passed; spec {spec.to_json()}")
            return results
        raise AssertionError("unreachable")

    def _attempt_seconds(self, first: Fault | None) -> float:
        """The deadline of an attempt: the rule's; a hung first attempt's rerun gets longer."""
        if first is not None and first.kind == "hang":
            return self.deadline.rerun_seconds(self.stop_at - time.monotonic())
        return self.deadline.seconds()

    def _after_fault(
        self, spec: CaseSpec, fault: Fault, first: Fault | None, attempt: int, error: PoolError
    ) -> Fault:
        """Decide after a failed attempt: rerun (returns the fault to remember), or raise."""
        if time.monotonic() > self.stop_at:
            raise BudgetExhausted  # no time to tell the implementation's fault from the machine's
        # Both attempts the implementation's kind of fault, or one already confirmed in this search
        # (shrinking a crash meets it again and again: its first confirmation stands).
        confirmed = first is not None and first.kind is not None
        if fault.kind is not None and (confirmed or fault.kind in self.confirmed):
            self.confirmed.add(fault.kind)
            self.fault_deadline_s = self.deadline.seconds()  # the rule's, as a replay's floor
            detail = fault.detail if first is None else f"{first.detail}; again: {fault.detail}"
            raise ImplementationFault(fault.kind, detail, spec) from error
        if attempt == 2:
            if first is not None and first.kind is not None:
                self.on_fault(f"{first.detail}; the rerun: {fault.detail}; spec {spec.to_json()}")
            raise InfraFault(error, spec) from error
        return fault


CHECK_JOB = "verify.execution.runner:check_job"


def check_job(payload: dict[str, Any], rank: execute.Rank) -> Any:
    """A worker's entry for `Runner.run_check`: the named check on this worker's device."""
    spec = CaseSpec.from_json(payload["spec"])
    return _named(payload["check"])(spec, resolve(payload["impl"]), payload["mutant"], rank)


def _named(ref: str) -> Callable[..., Any]:
    """The function ``"module:function"`` names."""
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)
