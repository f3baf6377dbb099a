"""The case features pairwise coverage spans, declared once, and the covering array over them.

A `CoverageFeature` is a name, its values (short strings), how a spec's field(s) map into one
value (``value_of``) and the fields that give a value (``realize``). Coverage counts pairs of
values of two features, reached when one judged example had both (`values`, `pairs_of`);
`greedy_rows` builds the rows that reach every wanted pair in few examples. Adding an option to
`CaseSpec` is adding one record to `FEATURES`: what an implementation claims of it, and what a
property judges, are derived from the adapter and the catalog (`verify.running.pairwise`).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from verify.cases.spec import (
    DTENSOR_LAYOUTS,
    DTYPE_PAIRS,
    GRADS,
    IGNORE_PATTERNS,
    LAYOUTS,
    LOSS_PATHS,
    REDUCTIONS,
    REGIMES,
    TARGET_PATTERNS,
    UPSTREAMS,
    CaseSpec,
    SpecError,
)
from verify.cases.strategies import regime_offsets
from verify.numerics.reference import IGNORE_INDEX
from verify.numerics.tolerances import DTYPES as DTYPE_KEYS
from verify.numerics.tolerances import dtype_key

Fields = dict[str, Any]
Value = tuple[str, str]  # (feature, value)
Pair = tuple[Value, Value]  # in `FEATURES` order
Row = dict[str, str]  # feature -> value

# The value a temperature other than 1 is realized with: a power of two, so the temperature
# property (which folds T into hidden exactly) judges the rows that carry it.
OTHER_TEMPERATURE = 0.5
CHUNKED = 2  # the chunk size of a "chunked" row: several chunks of its tokens
# The value each model option (`lce.LogitOptions`, the bias) is realized with where a row has it:
# a scale among the generator's, a cap the row's logits bend against (the normal regime's reach
# ~4-10), a bias of a few logits' deviation (within every dtype's `LOGIT_BOUND`),
# PaLM's z-loss coefficient times 100 (so its term shows in a 16-bit loss), a common smoothing.
OPTION_VALUES = {
    "logit_scale": 0.5, "softcap": 5.0, "bias": 0.5, "z_loss": 1e-2, "label_smoothing": 0.1,
}  # fmt: skip
PAIR_OF_KEY = {h if h == w else f"{h}_{w}": (h, w) for h, w in DTYPE_PAIRS}


@dataclass(frozen=True)
class CoverageFeature:
    """``value_of(spec)``: the spec's value; ``realize(fields, value)``: the field changes that
    give ``value`` to a spec whose fields (those realized so far included) are ``fields``."""

    name: str
    values: tuple[str, ...]
    value_of: Callable[[CaseSpec], str]
    realize: Callable[[Fields, str], Fields]


def _field(name: str, values: tuple[str, ...]) -> CoverageFeature:
    return CoverageFeature(name, values, lambda s: getattr(s, name), lambda f, v: {name: v})


def _flag(name: str, field: str, off: str, on: str, on_value: Any, off_value: Any = None):
    """A two-valued feature: ``off`` where the field is at ``off_value`` (its default)."""

    def value_of(spec: CaseSpec) -> str:
        return off if getattr(spec, field) == off_value else on

    return CoverageFeature(
        name, (off, on), value_of, lambda f, v: {field: off_value if v == off else on_value}
    )


def _dtype(fields_: Fields, value: str) -> Fields:
    hidden, weight = PAIR_OF_KEY[value]
    return {"hidden_dtype": hidden, "weight_dtype": weight}


def _regime(fields_: Fields, value: str) -> Fields:
    """The regime with its simplest offset at the row's dtype; one the generator never draws
    there (beyond `LOGIT_BOUND`) is no valid row."""
    key = dtype_key(fields_["hidden_dtype"], fields_["weight_dtype"])
    offsets = regime_offsets(key)
    if value not in offsets:
        raise SpecError(f"regime {value} is not drawn at dtype {key} (beyond its logit bound)")
    return {"regime": value, "offset": offsets[value][0], "scale": 1.0}


def _shards(fields_: Fields, value: str) -> Fields:
    """Even shards: 4 ids a rank (13 at TP = 1); uneven: one id more on rank 0."""
    tp = fields_["tp"]
    if tp == 1:
        if value == "uneven":
            raise SpecError("one rank's shard is always even: uneven shards need tp >= 2")
        return {}
    return {"vocab": 4 * tp + (value == "uneven"), "shards": None}


def _grad_hidden(fields_: Fields, value: str) -> Fields:
    if value == "partial" and fields_["tp"] == 1:
        raise SpecError("a partial grad_hidden (sequence parallel) needs tp >= 2")
    return {"reduce_hidden": value == "summed"}


def _tokens(fields_: Fields, value: str) -> Fields:
    """T = 0 and T = 1 (per sequence) are classes of their own; "several" keeps the row's."""
    return {"tokens": int(value)} if value != "several" else {}


def _effective_path(spec: CaseSpec) -> str:
    """The loss path the case takes: ``fast`` computes gradients in the forward of a scalar
    loss, and is the default path for ``reduction="none"`` or no gradient (lce's contract, and
    what a fast-path bug needs to show). A row counting ``fast`` there reached none of its pairs:
    the in-place scaling of saved gradients lived through a campaign of such rows."""
    inert = spec.loss_path == "fast" and (spec.reduction == "none" or spec.grads == "none")
    # kept logits serve a backward only: without a gradient nothing is kept
    inert |= spec.loss_path == "kept_logits" and spec.grads == "none"
    return "default" if inert else spec.loss_path


IGNORE_IDS = {"-100": IGNORE_INDEX, "0": 0, "-1": -1}


def _ignore_index_of(spec: CaseSpec) -> str:
    named = {v: k for k, v in IGNORE_IDS.items()}
    return named.get(spec.ignore_index, "pad")


def _ignore_index(fields_: Fields, value: str) -> Fields:
    """A pad id inside the vocabulary is its last id (drawn targets equal to it are ignored)."""
    return {"ignore_index": IGNORE_IDS.get(value, fields_["vocab"] - 1)}


# Realized in this order: shards set the vocabulary the pad id is taken from, the dtype the
# regime's offsets. The TP degree is fixed per slice (a feature of one value there).
FEATURES: tuple[CoverageFeature, ...] = (
    CoverageFeature("tp", ("1", "2", "4", "8"), lambda s: str(s.tp), lambda f, v: {"tp": int(v)}),
    CoverageFeature("shards", ("even", "uneven"),
                    lambda s: "even" if s.even_shards else "uneven", _shards),
    CoverageFeature("dtype", DTYPE_KEYS, lambda s: s.dtype_key, _dtype),
    CoverageFeature("regime", REGIMES, lambda s: s.regime, _regime),
    _field("reduction", REDUCTIONS),
    CoverageFeature("loss_path", LOSS_PATHS, _effective_path, lambda f, v: {"loss_path": v}),
    _field("grads", GRADS),
    _field("upstream", UPSTREAMS),
    _field("layout", LAYOUTS),
    _field("ignore", IGNORE_PATTERNS),
    CoverageFeature("ignore_index", ("-100", "0", "-1", "pad"), _ignore_index_of, _ignore_index),
    _field("target", TARGET_PATTERNS),
    CoverageFeature("tokens", ("0", "1", "several"),
                    lambda s: str(s.tokens) if s.tokens < 2 else "several", _tokens),
    _flag("inputs", "batch", "2-D", "3-D", 2, 0),
    _flag("tied", "tied", "untied", "tied", True, False),
    _flag("temperature", "temperature", "1", "!=1", OTHER_TEMPERATURE, 1.0),
    _flag("logit_scale", "logit_scale", "1", "!=1", OPTION_VALUES["logit_scale"], 1.0),
    _flag("softcap", "softcap", "none", "capped", OPTION_VALUES["softcap"]),
    _flag("bias", "bias", "none", "biased", OPTION_VALUES["bias"], 0.0),
    _flag("z_loss", "z_loss", "0", ">0", OPTION_VALUES["z_loss"], 0.0),
    _flag("label_smoothing", "label_smoothing", "0", ">0", OPTION_VALUES["label_smoothing"], 0.0),
    _flag("chunking", "chunk_size", "default", "chunked", CHUNKED),
    CoverageFeature("grad_hidden", ("summed", "partial"),
                    lambda s: "summed" if s.reduce_hidden else "partial", _grad_hidden),
    _field("dtensor", DTENSOR_LAYOUTS),
)  # fmt: skip
FEATURE_NAMES = tuple(f.name for f in FEATURES)
_ORDER = {name: index for index, name in enumerate(FEATURE_NAMES)}


def values(spec: CaseSpec) -> Row:
    """Each feature's value in ``spec``."""
    return {f.name: f.value_of(spec) for f in FEATURES}


def reached_pairs(spec: CaseSpec) -> set[Pair]:
    """The pairs a judged ``spec`` reaches: every pair of its values, but on a case with no
    valid token (no token, or every one ignored) only the pairs through the values that left
    none. Nothing is computed from the others there (every gradient is zero whatever the loss
    path, upstream or dtype): a pair such as fast x twice counted on an all-ignored row was
    never tried, and the in-place scaling of saved gradients it exposes lived through a plan
    whose one such row ignored its only token."""
    row = values(spec)
    emptied = _emptying_values(spec, row)
    pairs = pairs_of(row)
    return {p for p in pairs if p[0] in emptied or p[1] in emptied} if emptied else pairs


def _emptying_values(spec: CaseSpec, row: Row) -> set[Value]:
    """The values of ``row`` that leave ``spec`` no valid token (empty when it has one)."""
    if spec.num_tokens == 0:
        return {("tokens", row["tokens"])}
    if spec.ignore == "all":
        return {("ignore", "all")}
    if spec.num_tokens == 1 and spec.ignore in ("first", "chunk"):
        return {("ignore", spec.ignore), ("tokens", row["tokens"])}
    return set()


def pair(a: Value, b: Value) -> Pair:
    """The pair of two values of different features, in `FEATURES` order."""
    return (a, b) if _ORDER[a[0]] < _ORDER[b[0]] else (b, a)


def pairs_of(row: Mapping[str, str], names: Iterable[str] | None = None) -> set[Pair]:
    """Every pair of values of ``row`` (of the features ``names``, default all in the row)."""
    items = [(name, row[name]) for name in (names or row) if name in row]
    items.sort(key=lambda item: _ORDER[item[0]])
    return {(a, b) for i, a in enumerate(items) for b in items[i + 1 :]}


def pair_text(p: Pair) -> str:
    """``"dtype=bf16 & grads=twice"``: a pair as the report names it."""
    return " & ".join(f"{name}={value}" for name, value in p)


def apply(base: CaseSpec, row: Mapping[str, str]) -> CaseSpec:
    """``base`` with every value of ``row`` realized (in `FEATURES` order); raises
    `SpecError` when the values make no valid case, or one takes no effect in it (e.g.
    ``loss_path=fast`` with ``reduction=none`` is the default path: `_effective_path`)."""
    current: Fields = {f.name: getattr(base, f.name) for f in fields(CaseSpec)}
    for feature in FEATURES:
        if feature.name in row:
            current.update(feature.realize(current, row[feature.name]))
    spec = CaseSpec(**current)
    taken = values(spec)
    for name, value in row.items():
        if taken[name] != value:
            raise SpecError(f"{name}={value} takes no effect here (the case's is {taken[name]})")
    return spec


Target = tuple[str, Pair]  # (who must judge it, e.g. a property's name; the pair)
Wanted = dict[str, set[Pair]]  # who -> the pairs it must judge


def greedy_rows(
    domains: Mapping[str, tuple[str, ...]],
    wanted: Wanted,
    gains: Callable[[Row], Wanted],
    invalid: set[Pair],
    start: Callable[[Target, random.Random], Row] = lambda target, rng: dict(target[1]),
    *,
    candidates: int = 8,
    max_rows: int = 200,
    rng: random.Random | None = None,
) -> tuple[list[Row], set[Target]]:
    """Rows (one value per feature of ``domains``) until every pair each judge of ``wanted``
    wants is gained, AETG-style: each round makes ``candidates`` rows, each from the values
    ``start`` gives a target not yet gained (its pair, and whatever else its judge needs),
    choosing every other feature's value, in a random order, to complete the most pairs still
    wanted (counted once per judge) with the values chosen before it, never an ``invalid`` pair;
    the candidate that gains the most (``gains``: what a row's case gives each judge, which may
    depend on the whole row) is kept. A target started from in `GIVE_UP` rounds that gained
    nothing is given up (no row its judge judges carries the pair, e.g. chunk invariance needs
    two tokens, which a 2-D row with T = 1 lacks). Stops when every target is gained or given
    up, or at ``max_rows``. Returns the rows and the targets given up."""
    rng = rng or random.Random(0)
    left = {who: set(pairs) for who, pairs in wanted.items() if pairs}
    ordered = sorted((who, p) for who, pairs in left.items() for p in pairs)
    rows: list[Row] = []
    misses: Counter[Target] = Counter()
    given_up: set[Target] = set()
    while left and len(rows) < max_rows:
        need: Counter[Pair] = Counter()
        for pairs in left.values():
            need.update(pairs)
        ordered = [(who, p) for who, p in ordered if who in left and p in left[who]]
        best: tuple[int, Row, Wanted] | None = None
        started = [rng.choice(ordered) for _ in range(candidates)]
        for target in started:
            row = _candidate(domains, start(target, rng), need, invalid, rng)
            if row is None:
                continue
            got = gains(row)
            gained = sum(len(got[who] & left[who]) for who in got if who in left)
            if best is None or gained > best[0]:
                best = (gained, row, got)
        if best is None or best[0] == 0:
            misses.update(started)
            for who, p in {t for t in started if misses[t] >= GIVE_UP}:
                given_up.add((who, p))
                _drop(left, who, {p})
            continue
        rows.append(best[1])
        for who, pairs in best[2].items():
            _drop(left, who, pairs)
    return rows, given_up


GIVE_UP = 3  # fruitless rounds started from a target before it is given up


def _drop(left: Wanted, who: str, pairs: set[Pair]) -> None:
    if who in left:
        left[who] -= pairs
        if not left[who]:
            del left[who]


def _candidate(
    domains: Mapping[str, tuple[str, ...]],
    row: Row,
    need: Counter[Pair],
    invalid: set[Pair],
    rng: random.Random,
) -> Row | None:
    """``row`` completed value by value; None when its own values clash or some feature has no
    value compatible with the values chosen before it."""
    if pairs_of(row) & invalid:
        return None
    rest = [name for name in domains if name not in row]
    rng.shuffle(rest)
    for name in rest:
        rank = _ORDER[name]
        chosen = [((o, row[o]), _ORDER[o] < rank) for o in row]
        scores: dict[str, int] = {}
        for value in domains[name]:
            mine = (name, value)
            keys = [(other, mine) if before else (mine, other) for other, before in chosen]
            if not invalid.isdisjoint(keys):
                continue
            scores[value] = sum(need[key] for key in keys)
        if not scores:
            return None
        top = max(scores.values())
        row[name] = rng.choice([v for v, score in scores.items() if score == top])
    return row
