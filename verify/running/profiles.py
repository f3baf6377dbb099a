"""Hypothesis settings profiles of the engine: ``ci``, ``nightly`` and ``dev``.

``ci``: derandomized (the same examples every run unless a seed is given), no database writes, no
deadline (the interpreter and the pool have slow first calls), a bounded example count.
``nightly``: random, many examples, the database on (a cache of failures, not the record).
``dev``: few examples, verbose, for working on one property.
Each profile also sets the floor of the per-example deadline (`verify.execution.deadline`).
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from verify.execution.deadline import DEFAULT_FLOOR_S

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]

PROFILES = {
    "ci": {"max_examples": 30, "derandomize": True, "database": None},
    "nightly": {"max_examples": 2000, "derandomize": False},
    "dev": {"max_examples": 10, "derandomize": False, "database": None},
}
# Seconds a case may take before it counts as hung, at least (`--example-deadline-s`): on the CPU
# a Triton-interpreter case at TP 4 took 20 s on 2 loaded cores; on a GPU a first compile of a
# kernel specialization takes seconds. The deadline grows past it with the slowest examples.
DEADLINE_FLOORS = {"ci": DEFAULT_FLOOR_S, "nightly": DEFAULT_FLOOR_S, "dev": DEFAULT_FLOOR_S}


def profile_settings(
    name: str, *, max_examples: int | None = None, seed: int | None = None
) -> settings:
    """The settings of profile ``name``; ``max_examples`` overrides its count, and a ``seed``
    turns off derandomization so each seed draws different examples (the seed is then set with
    ``hypothesis.seed`` by the caller)."""
    _check_name(name)
    options = dict(PROFILES[name])
    if name == "nightly":
        options["database"] = DirectoryBasedExampleDatabase(".hypothesis/examples")
    if max_examples is not None:
        options["max_examples"] = max_examples
    if seed is not None:
        options["derandomize"] = False
    return settings(
        deadline=None,
        suppress_health_check=_SLOW_OK,
        verbosity=Verbosity.verbose if name == "dev" else Verbosity.normal,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        print_blob=False,
        **options,
    )


def example_deadline_floor(name: str) -> float:
    """The per-example deadline floor of profile ``name``, in seconds."""
    _check_name(name)
    return DEADLINE_FLOORS[name]


def _check_name(name: str) -> None:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}")


for _name in PROFILES:
    settings.register_profile(f"lce-{_name}", profile_settings(_name))
