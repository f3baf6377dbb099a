"""The per-example deadline: how long a worker may take over one case before it counts as hung.

The rule (docs/DESIGN.md): ``max(floor_s, FACTOR * the slowest example so far)``, the slowest
measured inside the worker (the case's own time, not the pipes'), so the deadline follows the
examples' own times: a loaded machine slows every example alike and the deadline with them, and a
case that hangs is stopped after ten of the slowest healthy examples, or the floor (a profile
setting: `verify.running.profiles`). A fixed deadline (``--example-deadline-s``) does not grow.

A case that did not answer in time is run once more on a fresh worker (`verify.execution.runner`),
under the rule with `RERUN_FACTOR` times the deadline (`ExampleDeadline.rerun_seconds`): a hung
kernel never answers, a slow one does. The first call of a JIT-compiled kernel is slow, and slow
again in the fresh worker, since the first attempt's compile died with its worker.
"""

from __future__ import annotations

from dataclasses import dataclass

# How many times the slowest healthy example a case may take before it counts as hung.
FACTOR = 10.0
# The floor when nothing says otherwise (the profiles set their own): a first example loads the
# implementation's modules, and on 2 loaded cores a Triton-interpreter case at TP 4 took 20 s.
DEFAULT_FLOOR_S = 60.0
# How many times the deadline a timed-out case's rerun gets. QuACK's cases (CuTe DSL compiles of
# each new shape class inside its call) took 41 s on average and up to 179 s on an H100 host whose
# 16 cores twelve concurrent searches shared (2026-12-07); rerun under the same 60 s deadline, ten
# were reported as hangs (docs/adapters-gpu.md).
RERUN_FACTOR = 5.0


class BudgetExhausted(BaseException):
    """Raised inside a search past its deadline to stop it; a BaseException, so Hypothesis does
    not take it for a failure of the test (and does not shrink it)."""


@dataclass
class ExampleDeadline:
    """The per-example deadline of one search's runner: ``floor_s``, or (unless ``fixed``)
    ``FACTOR`` times the slowest example it has `observe`d, whichever is longer."""

    floor_s: float = DEFAULT_FLOOR_S
    fixed: bool = False
    slowest_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.floor_s > 0:
            raise ValueError(f"the per-example deadline must be > 0 seconds, got {self.floor_s}")

    def seconds(self) -> float:
        """The deadline of the next example."""
        return self.floor_s if self.fixed else max(self.floor_s, FACTOR * self.slowest_s)

    def rerun_seconds(self, left_s: float) -> float:
        """The deadline of a timed-out case's rerun: `RERUN_FACTOR` times `seconds`, cut to the
        ``left_s`` seconds left in the search plus `seconds` (a run ends within its budget plus
        one deadline), never below `seconds`; a fixed deadline stays as it is (the caller's
        word on how long a hang takes to find)."""
        seconds = self.seconds()
        if self.fixed:
            return seconds
        return max(seconds, min(RERUN_FACTOR * seconds, left_s + seconds))

    def observe(self, seconds: float) -> None:
        """An example ran to its end in ``seconds`` (wall, send to last reply)."""
        self.slowest_s = max(self.slowest_s, seconds)
