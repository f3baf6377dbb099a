"""A search's deadline checked each time Hypothesis's engine tries a candidate, not only at the
end of an example.

Hypothesis can run long without calling the test: drawing inputs that a filter rejects,
hill-climbing a `target` score through overrunning or cached candidates, shrinking through
cached ones. A GPU campaign's searches (examples of ~40 ms) were seen there 30 s past the budget,
in the targeted phase's optimiser, and the overrun watchdog reported healthy searches as
infrastructure errors. `deadline_in_engine` makes the engine raise `BudgetExhausted` at its next
candidate instead: a clean point (no draw half done), during generation, the targeted phase and
shrinking only. Hypothesis's final replay of a failure and its explicit examples run the test
directly, so they finish and are reported as usual. Hypothesis offers no public hook for this:
the engine's two entries to the test are wrapped for the search's duration, on its own thread.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis.internal.conjecture.engine import ConjectureRunner

from verify.execution.deadline import BudgetExhausted

# Every candidate the engine tries passes one of these, cached or not.
ENGINE_ENTRIES = ("test_function", "cached_test_function")


@contextmanager
def deadline_in_engine(past_deadline: Callable[[], bool]) -> Iterator[None]:
    """Within the block, Hypothesis's engine raises `BudgetExhausted` before trying a candidate
    on this thread while ``past_deadline()`` is true. Other threads' searches are untouched."""
    owner = threading.get_ident()
    originals = {name: getattr(ConjectureRunner, name) for name in ENGINE_ENTRIES}

    def checked(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def entry(runner: ConjectureRunner, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == owner and past_deadline():
                raise BudgetExhausted
            return method(runner, *args, **kwargs)

        return entry

    for name, method in originals.items():
        setattr(ConjectureRunner, name, checked(method))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(ConjectureRunner, name, method)
