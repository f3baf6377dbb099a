"""Where an example's time goes: wall seconds per stage of a case, for the campaign report.

Code marks its stages with ``with stage("reference"):``; the seconds go to the *current*
`StageClock` (one per process by default; `recording` gives a job its own, whose totals travel
back with the job's result and are added on the driver with `add`). A stage's time excludes the
stages nested in it, so the stages of one example add up to its wall time without double counts.
Triton compiles are timed through Triton's JIT hooks (`watch_triton_compiles`) as ``compile``,
and the first launch of a compiled kernel in a process (its launcher built or loaded, its module
loaded onto the device) as ``load``, each carved out of whatever stage launched the kernel.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

# The stages, in the order the report lists them (see docs/report-format.md):
STAGES = (
    "compile",  # Triton JIT compiles (or loads from its disk cache) of new specializations
    "load",  # a specialization's first launch in a process: its launcher and module set up
    "kernel",  # lce forward and backward on the device, compiles and loads excluded
    "transfer",  # host <-> device copies of inputs and results
    "build",  # the case's inputs drawn from the spec (CPU)
    "reference",  # the float64 reference R (CPU)
    "baseline",  # the stock baseline B (CPU)
    "peer",  # production peers' runs (torch's and megatron-core's cross-entropy; peer properties)
    "dispatch",  # the driver <-> worker round trip besides the job's own stages (pickling, pipes)
    "compare",  # the properties' checks of outputs against R, B and each other
    "other",  # the rest of an example's wall time: Hypothesis drawing and bookkeeping
)


class StageClock:
    """Seconds per stage; nested stages are subtracted from the enclosing one (thread-local)."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter) -> None:
        self.timer = timer  # seconds, monotonic
        self.seconds: dict[str, float] = defaultdict(float)
        self.compiles = 0  # Triton compiles counted in ``seconds["compile"]``
        self._local = threading.local()
        self._lock = threading.Lock()

    def _stack(self) -> list[float]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        stack = self._stack()
        began = self.timer()
        stack.append(0.0)  # seconds of the stages nested in this one
        try:
            yield
        finally:
            elapsed = self.timer() - began
            nested = stack.pop()
            with self._lock:
                self.seconds[name] += elapsed - nested
            if stack:  # the enclosing stage's nested time: all of this one's
                stack[-1] += elapsed

    def add(self, seconds: dict[str, float], compiles: int = 0) -> None:
        """Count ``seconds`` (measured elsewhere, e.g. by a worker) inside the current stage."""
        with self._lock:
            for name, value in seconds.items():
                self.seconds[name] += value
            self.compiles += compiles
        stack = self._stack()
        if stack:
            stack[-1] += sum(seconds.values())

    def take(self) -> dict:
        """``{"seconds": {stage: s}, "compiles": n}`` so far, and a fresh start (picklable)."""
        with self._lock:
            taken = {"seconds": dict(self.seconds), "compiles": self.compiles}
            self.seconds.clear()
            self.compiles = 0
        return taken

    def add_taken(self, taken: dict) -> None:
        """`add` what another clock's `take` returned."""
        self.add(taken["seconds"], taken["compiles"])


_PROCESS_CLOCK = StageClock()
_current: ContextVar[StageClock] = ContextVar("stage_clock", default=_PROCESS_CLOCK)


def current() -> StageClock:
    return _current.get()


def stage(name: str):
    """``with stage(name):`` times a block into the current clock."""
    return _current.get().stage(name)


@contextmanager
def recording() -> Iterator[StageClock]:
    """A fresh clock for the block (a job's own stages, returned with its result)."""
    clock = StageClock()
    token = _current.set(clock)
    try:
        yield clock
    finally:
        _current.reset(token)


def watch_triton_compiles() -> None:
    """Time Triton's compiles as the ``compile`` stage and first launches as ``load``
    (idempotent; no-op without the hooks).

    Triton calls ``jit_cache_hook`` before it compiles a new specialization and
    ``jit_post_compile_hook`` after; launches of already compiled kernels call neither. A compiled
    kernel sets itself up on its first launch (``CompiledKernel._init_handles``: the launcher,
    the module on the device), which no hook brackets: it is wrapped here.
    """
    try:
        from triton import knobs
        from triton.compiler.compiler import CompiledKernel
    except ImportError:  # no Triton (or one without knobs): nothing is compiled to time
        return
    runtime = knobs.runtime
    if getattr(runtime, "jit_post_compile_hook", None) is _compiled:
        return
    runtime.jit_cache_hook = _compiling
    runtime.jit_post_compile_hook = _compiled
    set_up = getattr(CompiledKernel, "_init_handles", None)
    if set_up is not None:
        CompiledKernel._init_handles = _timed_set_up(set_up)


def _timed_set_up(set_up: Callable[[Any], None]) -> Callable[[Any], None]:
    def timed(kernel: Any) -> None:
        if getattr(kernel, "module", None) is not None:  # set up already: returns at once
            set_up(kernel)
            return
        with stage("load"):
            set_up(kernel)

    return timed


_compile_began = threading.local()


def _compiling(**_: object) -> bool:
    _compile_began.at = time.perf_counter()
    return False  # False: Triton goes on and compiles


def _compiled(**_: object) -> None:
    began = getattr(_compile_began, "at", None)
    if began is not None:
        current().add({"compile": time.perf_counter() - began}, compiles=1)
        _compile_began.at = None
