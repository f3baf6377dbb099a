"""The per-example deadline: how long a worker may take over one case before it counts as hung.

The rule (docs/DESIGN.md): ``max(floor_s, FACTOR * the slowest example so far)``, the slowest
measured inside the worker (the case's own time, not the pipes'), so the deadline follows the
examples' own times: a loaded machine slows every example alike and the deadline with them, and a
case that hangs is stopped after ten of the slowest healthy examples, or the floor (a profile
setting: `verify.running.profiles`). A fixed deadline (``--example-deadline-s``) does not grow.
"""

from __future__ import annotations

from dataclasses import dataclass

# How many times the slowest healthy example a case may take before it counts as hung.
FACTOR = 10.0
# The floor when nothing says otherwise (the profiles set their own): a first example loads the
# implementation's modules, and on 2 loaded cores a Triton-interpreter case at TP 4 took 20 s.
DEFAULT_FLOOR_S = 60.0


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

    def observe(self, seconds: float) -> None:
        """An example ran to its end in ``seconds`` (wall, send to last reply)."""
        self.slowest_s = max(self.slowest_s, seconds)
