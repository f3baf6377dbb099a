"""Hypothesis strategies for case specs: small, composable, named after what they produce.

Simplest values come first in every strategy, so a failure shrinks to a small readable spec.
`case_specs()` composes them into valid cases; `invalid_specs()` into cases lce must refuse.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from verify.cases.build import SPREAD_SCALE
from verify.cases.spec import (
    DTYPE_PAIRS,
    EXTENTS,
    FAULTS,
    GRADS,
    IGNORE_PATTERNS,
    LAYOUTS,
    REDUCTIONS,
    TARGET_PATTERNS,
    UPSTREAMS,
    CaseSpec,
    extent_sizes,
)
from verify.numerics.reference import IGNORE_INDEX
from verify.numerics.tolerances import dtype_key

# Largest |logit| each dtype key is generated with. The envelope tier of tolerances.yaml is
# relative to ||R|| (log-prob sized), while rounding a logit costs eps * |logit|: beyond these
# bounds a correct kernel (and the stock baseline) fails the envelope (see docs/bench/properties.md
# for the measured numbers). fp32_bf16/bf16: 2^-9 * 16 = 0.03 ~ rtol; fp16: 2^-12 * 16 ~ 4e-3.
LOGIT_BOUND = {"fp64": 1e4, "fp32": 130.0, "bf16": 16.0, "fp32_bf16": 16.0, "fp16": 16.0}


def token_counts(max_tokens: int = 24) -> st.SearchStrategy[int]:
    """Tokens per sequence: 0 and 1 are the edge cases, then a few to a couple of chunks."""
    return st.integers(0, max_tokens)


def hidden_sizes() -> st.SearchStrategy[int]:
    """H: small, not a multiple of 16 (5, 33), a tile multiple (16, 64)."""
    return st.sampled_from([8, 2, 5, 16, 33, 64])


def vocab_sizes(min_vocab: int = 1) -> st.SearchStrategy[int]:
    """V: tiny, primes and 2^k+1 (shards and tiles that do not divide), a few tiles."""
    odd = st.sampled_from([2, 3, 7, 17, 31, 64, 129, 257, 300])
    return st.one_of(st.integers(min_vocab, 16), odd.filter(lambda v: v >= min_vocab))


def batch_sizes() -> st.SearchStrategy[int]:
    """0 for 2-D ``[T, H]`` inputs, else the B of 3-D ``[B, T, H]``."""
    return st.sampled_from([0, 2, 1])


def dtype_pairs(pairs=DTYPE_PAIRS) -> st.SearchStrategy[tuple[str, str]]:
    return st.sampled_from(pairs)


def temperatures() -> st.SearchStrategy[float]:
    """1 first; powers of two (exact temperature equivariance) and others."""
    return st.sampled_from([1.0, 0.5, 2.0, 0.7, 1.3, 0.25])


def chunk_sizes() -> st.SearchStrategy[int | None]:
    """The torch backend's tokens per chunk: default (one chunk here) or small (many chunks)."""
    return st.one_of(st.none(), st.integers(1, 8))


def ignore_indices(vocab: int) -> st.SearchStrategy[int]:
    """The id marking ignored targets: -100 first (torch's default), then what real code passes:
    0, -1, and a pad id inside the vocabulary (the last id; 0 is one too), where drawn targets
    equal to it are ignored as well."""
    return st.sampled_from(list(dict.fromkeys([IGNORE_INDEX, 0, -1, vocab - 1])))


def seeds() -> st.SearchStrategy[int]:
    return st.integers(0, 2**16)


# The offsets of the regimes that shift logits, simplest first.
OFFSETS = {"offset": (10.0, -10.0, 100.0, -1e3, 1e4), "negative": (0.0, 10.0)}


def regime_offsets(dtype_key: str) -> dict[str, list[float]]:
    """The regimes drawn at a dtype key, each with its offsets (simplest first), within
    `LOGIT_BOUND`: a regime whose offsets all lie beyond the bound is not drawn there."""
    bound = LOGIT_BOUND[dtype_key]
    offsets = {"normal": [0.0], "peaked": [0.0]}
    if bound >= 100:
        offsets["negative"] = [c for c in OFFSETS["negative"] if 100 + abs(c) + 50 <= bound]
        offsets["offset"] = [c for c in OFFSETS["offset"] if abs(c) <= bound - 40]
        offsets["spread"] = [0.0]
    return {regime: allowed for regime, allowed in offsets.items() if allowed}


@st.composite
def logit_regimes(draw: st.DrawFn, dtype_key: str) -> tuple[str, float, float]:
    """``(regime, scale, offset)`` within `LOGIT_BOUND` of the dtype (normal first).

    Every regime makes the same draws (the offset's index is drawn for each): a case's choices
    then keep their positions when the regime changes. Hypothesis's targeted phase hill-climbs
    one choice at a time and, when a change moves the choices after it, retries the rest in
    every enclosing span: with the offset drawn for two regimes only, that cost 58,000
    overrunning attempts (55 of 84 s) in a 577-example nightly-profile search on the CPU."""
    bound = LOGIT_BOUND[dtype_key]
    offsets = regime_offsets(dtype_key)
    regime = draw(st.sampled_from(list(offsets)))
    scale = draw(st.sampled_from([s for s in (1.0, 0.3, 3.0, 10.0) if 4 * s + 10 <= bound]))
    allowed = offsets[regime]
    return regime, scale, allowed[draw(st.integers(0, 4)) % len(allowed)]


@st.composite
def case_specs(
    draw: st.DrawFn,
    *,
    backends: tuple[str, ...] = ("torch",),
    tp_sizes: tuple[int, ...] = (1,),
    pairs: tuple[tuple[str, str], ...] = DTYPE_PAIRS,
    max_tokens: int = 24,
    loss_paths: tuple[str, ...] = ("default",),
    dtensors: tuple[str, ...] = ("none",),
) -> CaseSpec:
    """A valid case reaching the input classes of docs/DESIGN.md, at one of ``tp_sizes`` and
    ``backends``, its loss computed by one of ``loss_paths`` (`verify.cases.spec.LOSS_PATHS`),
    its weight given as one of ``dtensors`` (`verify.cases.spec.DTENSOR_LAYOUTS`)."""
    tp = draw(st.sampled_from(tp_sizes))
    backend = draw(st.sampled_from(backends))
    if backend == "triton":  # Triton refuses fp64 weights (its kernels compute in fp32)
        pairs = tuple(p for p in pairs if p[1] != "fp64")
    hidden_dtype, weight_dtype = draw(dtype_pairs(pairs))
    regime, scale, offset = draw(logit_regimes(dtype_key(hidden_dtype, weight_dtype)))
    hidden_size = draw(hidden_sizes().filter(lambda h: h >= 2 or regime == "normal"))
    vocab = draw(vocab_sizes(min_vocab=tp))
    spec = CaseSpec(
        tokens=draw(token_counts(max_tokens)),
        hidden_size=hidden_size,
        vocab=vocab,
        batch=draw(batch_sizes()),
        tp=tp,
        hidden_dtype=hidden_dtype,
        weight_dtype=weight_dtype,
        reduction=draw(st.sampled_from(REDUCTIONS)),
        ignore=draw(st.sampled_from(IGNORE_PATTERNS)),
        target=draw(st.sampled_from(TARGET_PATTERNS)),
        regime=regime,
        scale=scale,
        offset=offset,
        temperature=draw(temperatures()),
        tied=tp == 1 and draw(st.booleans()),
        reduce_hidden=tp == 1 or draw(st.sampled_from([True, False])),
        layout=draw(st.sampled_from(LAYOUTS)),
        upstream=draw(st.sampled_from(("random", *(u for u in UPSTREAMS if u != "random")))),
        grads=draw(st.sampled_from(GRADS)),
        chunk_size=draw(chunk_sizes()),
        backend=backend,
        seed=draw(seeds()),
        ignore_index=draw(ignore_indices(vocab)),
    )
    # main_grad adds to its buffer on every backward: two backwards differ by design.
    paths = [p for p in loss_paths if p != "main_grad" or spec.grads != "twice"] or ["default"]
    # one path: no draw, so the default strategy's examples stay what they were
    path = paths[0] if len(paths) == 1 else draw(st.sampled_from(paths))
    spec = spec.with_(loss_path=path, **draw(model_options(_logit_budget(spec))))
    if tuple(dtensors) == ("none",):  # no draw: the plain strategy's examples stay the same
        return spec
    return _with_dtensor(spec, draw(st.sampled_from(dtensors)))


def _with_dtensor(spec: CaseSpec, layout: str) -> CaseSpec:
    """``spec`` with its weight as ``layout``, in what a DTensor case is modelled with
    (`verify.cases.spec`): untied, torch.chunk's rows, no main_grad, a replicated head's
    grad_hidden whole."""
    if layout == "none":
        return spec
    main_grad = spec.loss_path == "main_grad"
    return spec.with_(
        dtensor=layout, tied=False, loss_path="default" if main_grad else spec.loss_path,
        reduce_hidden=spec.reduce_hidden or layout == "replicate",
    )  # fmt: skip


def _logit_budget(spec: CaseSpec) -> float:
    """How far past the regime's logits `LOGIT_BOUND` leaves room (as `logit_regimes` bounds
    them: ``4 * scale + 10``, an offset within 40 of the bound, a negative row 150 below 0)."""
    scale = max(spec.scale, SPREAD_SCALE) if spec.regime == "spread" else spec.scale
    used = 4 * scale + 10
    if spec.regime == "offset":
        used = max(used, abs(spec.offset) + 40)
    elif spec.regime == "negative":
        used = max(used, abs(spec.offset) + 150)
    return LOGIT_BOUND[spec.dtype_key] - used


# Each model option's values, its default first. Softcaps: Gemma 2's final 30, and caps the
# logits saturate against. Logit scales: Cohere's 0.0625 among them. Biases: the standard
# deviation in logits. z-loss: PaLM's 1e-4 and coefficients that dominate the loss.
OPTION_VALUES: dict[str, tuple[Any, ...]] = {
    "softcap": (None, 30.0, 5.0, 1.0),
    "logit_scale": (1.0, 0.5, 2.0, 0.0625),
    "bias": (0.0, 0.5, 2.0, 8.0),
    "z_loss": (0.0, 1e-4, 1e-2, 1.0),
    "label_smoothing": (0.0, 0.1, 0.5, 1.0),
}


@st.composite
def model_options(draw: st.DrawFn, bias_bound: float = math.inf) -> dict[str, Any]:
    """The model options of a case beyond the temperature: half of the cases have none (the
    plain head, where shrinking goes), the others draw each option among its `OPTION_VALUES`
    (its default included, so options meet in every combination). A bias adds up to ~3 times its
    deviation to a logit: only biases within ``bias_bound`` logits are drawn (`LOGIT_BOUND`).

    Every case makes the same draws (as `logit_regimes`): its choices keep their positions when
    the switch flips."""
    with_options = draw(st.booleans())
    picked = {
        name: values[draw(st.integers(0, len(values) - 1))]
        for name, values in OPTION_VALUES.items()
    }
    if not with_options:
        return {}
    if 3 * picked["bias"] > bias_bound:
        picked["bias"] = 0.0
    return picked


def landmark_specs(
    tp_sizes: tuple[int, ...] = (1,), backends: tuple[str, ...] = ("torch",)
) -> list[CaseSpec]:
    """One small spec per input class of docs/DESIGN.md, run first by every search (explicit phase):
    the search then starts from every class instead of waiting to draw it."""
    base = CaseSpec(tokens=5, hidden_size=8, vocab=13, backend=backends[0], upstream="random")
    specs = [
        base,
        base.with_(regime="peaked", target="edges", ignore="random"),
        base.with_(regime="negative", reduction="sum", chunk_size=2),
        base.with_(regime="offset", offset=100.0, layout="transposed"),
        base.with_(regime="spread", batch=2, layout="sliced", upstream="strided"),
        base.with_(temperature=0.5, reduction="none", upstream="zero_row0", tied=True),
        base.with_(hidden_dtype="bf16", weight_dtype="bf16", ignore="chunk", chunk_size=1),
        base.with_(hidden_dtype="fp32", weight_dtype="bf16", grads="twice"),
        base.with_(hidden_dtype="fp16", weight_dtype="fp16", ignore="all", reduction="mean"),
        base.with_(tokens=1, vocab=1, upstream="expanded"),
        base.with_(tokens=24, batch=2, vocab=257, chunk_size=7),
        # model options: a capped, biased, smoothed head; Gemma 2's bf16 head with PaLM's z-loss
        base.with_(regime="peaked", softcap=5.0, bias=2.0, label_smoothing=0.1, temperature=2.0),
        base.with_(
            hidden_dtype="bf16",
            weight_dtype="bf16",
            softcap=30.0,
            logit_scale=0.5,
            z_loss=1e-4,
            reduction="sum",
        ),
        base.with_(temperature=0.7, bias=0.5, z_loss=1e-2, label_smoothing=0.5, chunk_size=2),
        # a DTensor head (plain tensors for an implementation that does not claim one)
        base.with_(dtensor="shard0", bias=0.5, layout="sliced"),
        # past real kernels' tile and chunk boundaries, one dimension at a time, otherwise plain
        # (fp32's tight tolerances, the normal regime, every token valid: 4097 tokens leave a
        # one-token tail past any power-of-two chunk, which an ignored last token would hide)
        *(base.with_(**extent_sizes(e, 1, base.vocab)) for e in EXTENTS[1:]),
    ]
    for tp in (t for t in tp_sizes if t > 1):
        specs.append(base.with_(tp=tp, vocab=4 * tp + 1, target="edges", ignore="first"))
        specs.append(base.with_(tp=tp, vocab=8 * tp, target="high", reduce_hidden=False))
        specs.append(base.with_(tp=tp, vocab=4 * tp + 1, dtensor="replicate", ignore="random"))
        # the shards' lse and smoothing sums merged across ranks, the bias sharded with the rows
        specs.append(
            base.with_(
                tp=tp, vocab=4 * tp + 3, z_loss=1e-2, label_smoothing=0.1, bias=1.0, softcap=5.0
            )
        )
    return [spec.with_(backend=b) for b in backends for spec in specs]


def landmarks_at(tp: int, backend: str) -> list[CaseSpec]:
    """`landmark_specs` of one slice: every input class at TP degree ``tp`` (a class needing TP
    1, tied weights, untied there; vocabularies widened to one id per rank, a large extent's to
    its ids per rank), on ``backend``."""
    lifted = [
        spec.with_(
            tp=tp, tied=False,
            **{"vocab": max(spec.vocab, tp)} | extent_sizes(spec.extent, tp, spec.vocab),
        ) if spec.tp != tp else spec
        for spec in landmark_specs((1, tp), (backend,))
    ]  # fmt: skip
    return [spec for index, spec in enumerate(lifted) if spec not in lifted[:index]]


LOW_PRECISION = (("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "bf16"))
NON_UNIFORM = ("random", "strided", "zero_row0", "logprob_only")  # upstreams that vary per row


def campaign_specs(
    *,
    backends: tuple[str, ...] = ("torch",),
    tp_sizes: tuple[int, ...] = (1,),
    pairs: tuple[tuple[str, str], ...] = DTYPE_PAIRS,
    loss_paths: tuple[str, ...] = ("default",),
    dtensors: tuple[str, ...] = ("none",),
) -> st.SearchStrategy[CaseSpec]:
    """`case_specs`, half of the time in the precision regimes that expose a second rounding:
    a dtype below fp32 on peaked rows (a log-prob of ~0 from logits of ~|z|), an upstream that
    varies per row, many chunks (the torch backend sums each chunk's partial gradient). They come
    first (a one_of's first branch is where generation starts and shrinking goes), so a
    campaign meets them in its first examples instead of after hundreds. ``loss_paths``: the
    scalar-loss paths the implementation has (`verify.cases.spec.LOSS_PATHS`), each drawn;
    ``dtensors``: how its weight may be given (`verify.cases.spec.DTENSOR_LAYOUTS`)."""
    drawn = {
        "backends": backends, "tp_sizes": tp_sizes, "loss_paths": loss_paths, "dtensors": dtensors,
    }  # fmt: skip
    general = case_specs(pairs=pairs, **drawn)
    low = tuple(p for p in pairs if p in LOW_PRECISION)
    if not low:
        return general
    precise = case_specs(pairs=low, **drawn).map(_second_rounding)
    return st.one_of(precise, general)


def _second_rounding(spec: CaseSpec) -> CaseSpec:
    upstream = spec.upstream if spec.upstream in NON_UNIFORM else "random"
    return spec.with_(regime="peaked", upstream=upstream, chunk_size=spec.chunk_size or 1)


@st.composite
def invalid_specs(draw: st.DrawFn, *, tp_sizes: tuple[int, ...] = (1,)) -> CaseSpec:
    """A small case with one fault (bad target id, temperature, shape or dtype)."""
    spec = draw(case_specs(tp_sizes=tp_sizes, pairs=(("fp32", "fp32"), ("bf16", "bf16"))))
    fault = draw(st.sampled_from([f for f in FAULTS if f != "none"]))
    return spec.with_(fault=fault, tokens=max(spec.tokens, 1), ignore="none", tied=False)
