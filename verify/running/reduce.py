"""Shrinking a failure Hypothesis does not shrink: one found on an explicit example (a landmark
spec, a pairwise covering row), which it reports as it was. `reduce_failure` first tries every
field but the sizes at its simplest value at once, then moves the spec's fields one at a time
towards the simplest spec the implementation gets (sizes down a few steps, every other field to
its simplest value) and keeps each move that still fails the same checks, until no move does."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from verify.cases.spec import CaseSpec
from verify.execution.deadline import BudgetExhausted
from verify.execution.runner import InfraFault
from verify.properties.verdict import PropertyVerdict

# Sizes first (the smallest case says most), in the order Hypothesis's strategies simplify them.
SIZES = ("tokens", "batch", "vocab", "hidden_size")
HIDDEN_ORDER = (8, 2, 5, 16, 33, 64)  # `verify.cases.strategies.hidden_sizes`, simplest first
BATCH_ORDER = (0, 2, 1)  # `verify.cases.strategies.batch_sizes`
HALVED_FROM = 301  # past every size the generator draws (V <= 300) and the covering rows' H = 160
# Fields a reduction leaves as they are: what the slice and the property set, and the seed (any
# other draw is as simple).
KEPT = ("tp", "backend", "fault", "transform", "seed", "shards")

Check = Callable[[CaseSpec], list[PropertyVerdict]]


def reduce_failure(
    spec: CaseSpec,
    failing: list[PropertyVerdict],
    check: Check,
    simplest: CaseSpec,
    until: float,
) -> tuple[CaseSpec, list[PropertyVerdict]]:
    """The smallest spec found from ``spec`` whose ``check`` still fails one of the (property,
    output) pairs ``failing`` failed, and its failing verdicts; it stops at ``until``
    (``time.monotonic()``) with what it has."""
    wanted = {(v.property, v.output) for v in failing}
    current, verdicts = spec, failing
    # First every field but the sizes at its simplest at once: a covering row sets most of
    # them, and one probe (a worker's life, for a crash) beats one per field when it holds.
    jump = _simplest_but_sizes(current, simplest)
    if jump is not None and jump != current and time.monotonic() < until:
        try:
            failed = _failing(check, jump, wanted)
        except (BudgetExhausted, InfraFault):
            return current, verdicts
        if failed:
            current, verdicts = jump, failed
    moved = True
    while moved and time.monotonic() < until:
        moved = False
        for name, value in _moves(current, simplest):
            if time.monotonic() >= until:
                break
            try:
                candidate = current.with_(**{name: value})
            except ValueError:
                continue  # a combination the spec refuses (e.g. vocab < tp)
            try:
                failed = _failing(check, candidate, wanted)
            except (BudgetExhausted, InfraFault):  # no time, or no workers: what it has
                return current, verdicts
            if failed:  # the moves from here on: a larger value of this field is no move now
                current, verdicts, moved = candidate, failed, True
                break
    return current, verdicts


def _failing(check: Check, spec: CaseSpec, wanted: set[tuple[str, str]]) -> list[PropertyVerdict]:
    """``spec``'s failing verdicts if one of them is ``wanted``, else none (raising is no
    reproduction: another failure)."""
    try:
        verdicts = check(spec)
    except Exception:
        return []
    failed = [v for v in verdicts if v.failed]
    return failed if any((v.property, v.output) in wanted for v in failed) else []


def _simplest_but_sizes(spec: CaseSpec, simplest: CaseSpec) -> CaseSpec | None:
    """``spec`` with every field `_moves` would move, but the sizes, at its simplest value;
    None when that is no valid spec."""
    changes = {name: value for name, value in _moves(spec, simplest) if name not in SIZES}
    try:
        return spec.with_(**changes)
    except ValueError:
        return None


def _moves(spec: CaseSpec, simplest: CaseSpec) -> Iterator[tuple[str, Any]]:
    """Each field's simpler values than ``spec``'s, simplest first."""
    for name in SIZES:
        yield from ((name, value) for value in _smaller(name, getattr(spec, name), spec.tp))
    for name in CaseSpec.__dataclass_fields__:
        if name in (*SIZES, *KEPT):
            continue
        target = getattr(simplest, name)
        if getattr(spec, name) != target:
            yield name, target


def _smaller(name: str, value: int, tp: int) -> list[int]:
    """Smaller values of size ``name``, smallest first. Tokens stop at 1: the empty input is a
    class of its own (`verify.running.search.trigger` leaves it out alone), and a failure found
    with tokens, shrunk to none, was left out only there and found again at T = 1. Past the
    generator's sizes (`HALVED_FROM`), half plus one comes too: from an extent's 2^k + 1
    (`verify.cases.spec.EXTENTS`) a failure at a tile boundary halves down to the first size
    past it (a 512-token chunk's tail: 513)."""
    if name == "batch":
        order = BATCH_ORDER
    elif name == "hidden_size" and value < HALVED_FROM:
        order = HIDDEN_ORDER
    else:
        low = {"tokens": min(value, 1), "vocab": tp}.get(name)
        start = HIDDEN_ORDER if low is None else (low, low + 1, low + 2)
        halves = (value // 2, value // 2 + 1) if value >= HALVED_FROM else (value // 2,)
        order = tuple(dict.fromkeys((*start, *halves, value - 1)))
    return [v for v in order if (v in order[: order.index(value)] if value in order else v < value)]
