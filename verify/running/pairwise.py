"""Pairwise coverage of one slice: which pairs of case-feature values (`verify.cases.coverage`)
the implementation supports at this backend x TP degree, which of them each property judges, and
the covering rows the slice's valid search runs first, right after the landmark specs.

What the implementation supports is derived from its adapter: a value is supported when a case
carrying it survives `verify.adapters.features.coerce` unchanged (the capability records decide,
none is declared again here) and `CaseSpec` accepts it; a pair when a case carrying both does.
What a property judges is derived from its catalog record (`Property.covers`): a value is in a
property's scope when some supported case with that value is covered by it. A property that
judges every supported value counts every supported pair; one that judges part of the slice
(e.g. shift invariance, only offset rows) counts the pairs through the values that select its
part (its *selecting features*: those with a value outside its scope), each within its scope:
for shift invariance, every value met on an offset row. The rows are built greedily so that every
such (property, pair) is judged once (`verify.cases.coverage.greedy_rows`).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any

from verify.adapters.features import coerce
from verify.adapters.interface import Adapter
from verify.cases import coverage
from verify.cases.coverage import FEATURES, Pair, Row, Target, Value
from verify.cases.spec import DTYPE_PAIRS, CaseSpec
from verify.properties.catalog import get
from verify.properties.rounding_model import expected_dof
from verify.results.coverage_report import universe

# What every covering row is made of besides its feature values: a hidden size and token count
# that give the statistical tier of `verify.numerics.compare` its 256 degrees of freedom on both
# gradients (H - V per grad_hidden row: 147 at TP = 1, so two valid tokens suffice; at H = 96 a
# row needed four, and the double-rounded-gradient mutant lived through 102 planned examples),
# a vocabulary that is no tile multiple, H no multiple of the interpreter's 64-wide H tile. Small
# enough that a row costs what a landmark does.
ROW_BASE = {"tokens": 8, "hidden_size": 160, "vocab": 13, "upstream": "random"}
CANDIDATES = 6  # candidate rows per greedy round (more: slightly fewer rows, slower plan)
PLAN_SEED = 0  # the rows' values do not depend on the campaign's seed (their data does)
NOT_CLAIMED = "not claimed"
INVALID = "not a valid case"
LEFT_OUT = "left out by the campaign's options"
OTHER_SLICE = "another slice's"


@dataclass
class SlicePlan:
    """The coverage of one slice: supported values (``domains``; a feature with one value here,
    e.g. the TP degree, pairs with nothing), what is not supported and why, each property's
    scope, and the covering rows (specs, landmarks not included)."""

    domains: dict[str, tuple[str, ...]]
    unsupported: dict[Value, str]  # value -> reason
    invalid: dict[Pair, str]  # pair of supported values -> why no case has both
    # property -> {"outside": [values], "selects": [features], "unjudged": [pairs]}: unjudged,
    # pairs of values in its scope that no case it judges carries together (given up by the plan)
    scopes: dict[str, dict[str, Any]]
    rows: list[CaseSpec] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """What the report needs to count against (JSON-safe; `universe` rebuilds each
        property's pairs from it)."""
        return {
            "features": {name: list(values) for name, values in self.domains.items()},
            "not_claimed": [
                {"value": f"{name}={value}", "reason": reason}
                for (name, value), reason in sorted(self.unsupported.items())
                if reason != OTHER_SLICE
            ],
            "invalid": [
                {"pair": coverage.pair_text(p), "reason": reason}
                for p, reason in sorted(self.invalid.items())
            ],
            "properties": self.scopes,
            "rows": len(self.rows),
        }


class _Slice:
    """The realization and judgement of rows at one slice (cached per row)."""

    def __init__(
        self,
        adapter: Adapter,
        backend: str,
        tp: int,
        pairs: tuple[tuple[str, str], ...],
        exclude: tuple[str, ...],
    ) -> None:
        self.adapter, self.pairs = adapter, pairs
        self.exclude = [tuple(item.split("=", 1)) for item in exclude]
        self.base = CaseSpec(backend=backend, tp=tp, **ROW_BASE)
        self._specs: dict[tuple, CaseSpec | str] = {}

    def spec(self, row: Row) -> CaseSpec | str:
        """The case of ``row`` (coerced), or why there is none (`NOT_CLAIMED`, `INVALID`)."""
        key = tuple(sorted(row.items()))
        if key not in self._specs:
            self._specs[key] = self._realize(row)
        return self._specs[key]

    def _realize(self, row: Row) -> CaseSpec | str:
        try:
            spec = coverage.apply(self.base, row)
        except ValueError as exc:
            return f"{INVALID}: {exc}"
        if spec.tp != self.base.tp:
            return OTHER_SLICE
        fitted = coerce(self.adapter, spec)
        if fitted != spec:  # the adapter's limits resized it: realize the values on its sizes
            try:
                fitted = coerce(self.adapter, coverage.apply(fitted, row))
            except ValueError as exc:
                return f"{INVALID}: {exc}"
        got = coverage.values(fitted)
        if any(got[name] != value for name, value in row.items()):
            return NOT_CLAIMED
        left_out = any(str(getattr(fitted, name)) == value for name, value in self.exclude)
        if left_out or (fitted.hidden_dtype, fitted.weight_dtype) not in self.pairs:
            return LEFT_OUT
        return fitted


@lru_cache(maxsize=64)
def plan_slice(
    adapter: Adapter,
    backend: str,
    tp: int,
    names: tuple[str, ...],
    landmarks: tuple[CaseSpec, ...] = (),
    pairs: tuple[tuple[str, str], ...] = DTYPE_PAIRS,
    exclude: tuple[str, ...] = (),
) -> SlicePlan:
    """The `SlicePlan` of ``adapter`` at ``backend`` x TP ``tp`` for the properties ``names``
    (those judging valid cases), its rows reaching what ``landmarks`` do not; ``pairs`` and
    ``exclude``: the campaign's ``--dtypes`` and ``--exclude`` (`CampaignConfig`). Cached: the
    self-test plans the same slice for every mutant."""
    where = _Slice(adapter, backend, tp, pairs, exclude)
    domains, unsupported = _domains(where)
    invalid = _invalid_pairs(where, domains)
    names = tuple(n for n in names if not get(n).faults)
    pool = _broad_rows(where, domains, invalid)
    plan = SlicePlan(domains, unsupported, invalid, {})
    plan.scopes = {name: _scope(where, name, domains, pool, invalid) for name in names}
    record = plan.record()
    universes = {name: universe(record, name) for name in names}
    wanted = {name: set(pairs) for name, pairs in universes.items()}
    for spec in landmarks:
        for name, pairs in judged(spec, names, universes).items():
            wanted[name] -= pairs

    @cache
    def reached(key: tuple[tuple[str, str], ...]) -> dict[str, set[Pair]]:
        spec = where.spec(dict(key))
        return {} if isinstance(spec, str) else judged(spec, names, universes)

    def gains(row: Row) -> dict[str, set[Pair]]:
        return reached(tuple(sorted(row.items())))

    def start(target: Target, rng: random.Random) -> Row:
        """The target's pair, with a value in the property's scope for each feature that
        selects its cases."""
        name, p = target
        row = dict(p)
        scope = plan.scopes[name]
        for feature in scope["selects"]:
            inside = [v for v in domains[feature] if f"{feature}={v}" not in scope["outside"]]
            if feature not in row and inside:
                row[feature] = rng.choice(inside)
        return row

    rows, given_up = coverage.greedy_rows(
        domains, wanted, gains, set(invalid), start, candidates=CANDIDATES,
        rng=random.Random(PLAN_SEED),
    )  # fmt: skip
    for name, p in sorted(given_up):
        plan.scopes[name].setdefault("unjudged", []).append(coverage.pair_text(p))
    specs = [spec.with_(seed=index) for index, row in enumerate(rows)
             if not isinstance(spec := where.spec(row), str)]  # fmt: skip
    # The empty batch and T = 1 first, as the generator draws its simplest sizes first: a kernel
    # that fails on them is found at once, before the slice's share runs out. Within each size,
    # the rows the statistical tier judges most of first: one extra rounding of a gradient shows
    # nowhere else, and only on 16-bit gradients with enough elements.
    plan.rows = sorted(specs, key=lambda spec: (min(spec.tokens, 2), -expected_dof(spec)))
    return plan


def judged(
    spec: CaseSpec, names: Iterable[str], universes: dict[str, set[Pair]]
) -> dict[str, set[Pair]]:
    """What a judged ``spec`` gives each property of ``names`` that covers it: the pairs of its
    values that the property counts."""
    pairs = coverage.reached_pairs(spec)
    return {n: pairs & universes[n] for n in names if get(n).covers(spec)}


def _domains(where: _Slice) -> tuple[dict[str, tuple[str, ...]], dict[Value, str]]:
    """Each feature's supported values here, and each other value with its reason: the first
    reason met on the rows that carry it (alone, or with one other value to make it valid)."""
    domains, unsupported = {}, {}
    helpers = [{f.name: v} for f in FEATURES for v in f.values]
    for feature in FEATURES:
        kept = []
        for value in feature.values:
            reason = _support(where, {feature.name: value}, helpers)
            if reason is None:
                kept.append(value)
            else:
                unsupported[(feature.name, value)] = reason
        domains[feature.name] = tuple(kept)
    return domains, unsupported


def _support(where: _Slice, row: Row, helpers: list[Row]) -> str | None:
    """None when ``row`` (or ``row`` with one helper value) is a supported case, else why not
    (not claimed wins over invalid: the implementation's word is the more informative)."""
    first = where.spec(row)
    if not isinstance(first, str):
        return None
    reasons = [first]
    for helper in helpers:
        if helper.keys() & row.keys():
            continue
        got = where.spec({**row, **helper})
        if not isinstance(got, str):
            return None
        reasons.append(got)
    return NOT_CLAIMED if NOT_CLAIMED in reasons else first


def _invalid_pairs(where: _Slice, domains: dict[str, tuple[str, ...]]) -> dict[Pair, str]:
    """Pairs of supported values no case carries (e.g. main_grad with two backwards)."""
    helpers = [{name: v} for name, values in domains.items() for v in values]
    varying = [name for name, values in domains.items() if len(values) > 1]
    invalid = {}
    for a_name, b_name in itertools.combinations(varying, 2):
        for a, b in itertools.product(domains[a_name], domains[b_name]):
            reason = _support(where, {a_name: a, b_name: b}, helpers)
            if reason is not None:
                invalid[coverage.pair((a_name, a), (b_name, b))] = reason
    return invalid


def _broad_rows(
    where: _Slice, domains: dict[str, tuple[str, ...]], invalid: dict[Pair, str]
) -> list[Row]:
    """Rows meeting every valid pair once, whoever judges them: the pool in which a property's
    scope is looked for."""
    varying = [name for name, values in domains.items() if len(values) > 1]
    wanted = {
        coverage.pair((a, u), (b, v))
        for a, b in itertools.combinations(varying, 2)
        for u, v in itertools.product(domains[a], domains[b])
    }

    def gains(row: Row) -> dict[str, set[Pair]]:
        if isinstance(where.spec(row), str):
            return {}
        return {"*": coverage.pairs_of(row)}

    rows, _ = coverage.greedy_rows(
        domains, {"*": wanted - set(invalid)}, gains, set(invalid), candidates=CANDIDATES,
        rng=random.Random(PLAN_SEED),
    )  # fmt: skip
    return rows


def _scope(
    where: _Slice,
    name: str,
    domains: dict[str, tuple[str, ...]],
    pool: list[Row],
    invalid: dict[Pair, str],
) -> dict[str, Any]:
    """Property ``name``'s scope: the supported values no covered case carries (``outside``:
    each put into every pool row the property covers, the row's values it clashes with
    repaired), and its selecting features (those with a value outside). The rows' base case
    (no option, untied, several tokens) and its variations in one value are looked at with the
    pool: a property judging only a conjunction of plain values (megatron_peer: no option at all
    and even shards; graph_replay: both gradients on the default path) may meet no pool row,
    and would otherwise count nothing as judged."""
    prop = get(name)

    def covered(row: Row) -> bool:
        spec = where.spec(row)
        return not isinstance(spec, str) and prop.covers(spec)

    base = coverage.values(where.base)
    plain = [{**base, f: v} for f, values in domains.items() for v in values]  # base among them
    hits = [row for row in (*pool, *plain) if covered(row)]
    outside = []
    for feature, values in domains.items():
        for value in values:
            if any(row[feature] == value for row in hits):
                continue
            tries = (_repaired({**row, feature: value}, feature, domains, invalid) for row in hits)
            if not any(covered(row) for row in tries if row is not None):
                outside.append(f"{feature}={value}")
    selects = sorted({v.split("=", 1)[0] for v in outside})
    return {"outside": outside, "selects": selects}


def _repaired(
    row: Row, kept: str, domains: dict[str, tuple[str, ...]], invalid: dict[Pair, str]
) -> Row | None:
    """``row`` with each value that makes an invalid pair with another changed to the first
    value that makes none (``kept``'s value stays); None when no such value exists."""
    for name in domains:
        if name == kept:
            continue
        clash = any(
            coverage.pair((name, row[name]), (o, row[o])) in invalid for o in row if o != name
        )
        if not clash:
            continue
        fits = [
            v for v in domains[name]
            if not any(coverage.pair((name, v), (o, row[o])) in invalid for o in row if o != name)
        ]  # fmt: skip
        if not fits:
            return None
        row[name] = fits[0]
    return row
