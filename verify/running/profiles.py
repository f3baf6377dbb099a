"""Hypothesis settings profiles of the engine: ``ci``, ``nightly`` and ``dev``.

``ci``: derandomized (the same examples every run unless a seed is given), no database writes, no
deadline (the interpreter and the pool have slow first calls), a bounded example count.
``nightly``: random, many examples, the database on (a cache of failures, not the record).
``dev``: few examples, verbose, for working on one property.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis.database import DirectoryBasedExampleDatabase

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]

PROFILES = {
    "ci": {"max_examples": 30, "derandomize": True, "database": None},
    "nightly": {"max_examples": 2000, "derandomize": False},
    "dev": {"max_examples": 10, "derandomize": False, "database": None},
}


def profile_settings(
    name: str, *, max_examples: int | None = None, seed: int | None = None
) -> settings:
    """The settings of profile ``name``; ``max_examples`` overrides its count, and a ``seed``
    turns off derandomization so each seed draws different examples (the seed is then set with
    ``hypothesis.seed`` by the caller)."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}")
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


for _name in PROFILES:
    settings.register_profile(f"lce-{_name}", profile_settings(_name))
