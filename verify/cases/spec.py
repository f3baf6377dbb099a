"""`CaseSpec`: the small, frozen, JSON-serializable description of one generated case.

Every tensor of a case is a function of its spec alone (see `verify.cases.build`), so a spec
saved as one JSON line replays the same numbers at any TP degree and on any machine.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

from lce.options import LogitOptions
from verify.numerics.reference import IGNORE_INDEX
from verify.numerics.tolerances import dtype_key

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}
# (hidden, weight) pairs with a tolerance entry: equal dtypes, and the post-norm fp32 x bf16 case.
DTYPE_PAIRS = (
    ("fp32", "fp32"),
    ("bf16", "bf16"),
    ("fp16", "fp16"),
    ("fp32", "bf16"),
    ("fp64", "fp64"),
)
REDUCTIONS = ("mean", "sum", "none")
IGNORE_PATTERNS = ("none", "first", "random", "chunk", "all")
# random: uniform ids; edges: ids at 0, V-1 and every TP=2/4 shard boundary +-1 (first and last
# lanes of a shard, i.e. its last partial tile); high: all ids in the top quarter, so at TP >= 2
# every row's target lives on another rank for all but the last rank; repeated: one id everywhere.
TARGET_PATTERNS = ("random", "edges", "high", "repeated")
# normal: logits ~ N(0, scale^2); peaked: target logit = row max + 10 (where the geometry allows:
# always for H >= V); negative: every logit
# <= -100 - |offset|; offset: a common constant added to all logits (through a constant feature);
# spread: a row spread of ~scale*8 logits, so exp underflows for most lanes.
REGIMES = ("normal", "peaked", "negative", "offset", "spread")
LAYOUTS = ("contiguous", "transposed", "sliced")
UPSTREAMS = ("ones", "scalar", "random", "zero_row0", "strided", "expanded", "logprob_only")
# Problem sizes past the tile and chunk boundaries of real kernels, one dimension at a time, the
# others small: what the generator's own sizes (T <= 24, H <= 64, V <= 300) never cross. long:
# 4097 tokens, past token chunks of up to 4096 (verl's 512, QuACK's 4096), each rank holding
# more than 4 H ids so that chunks sized by V / H (Liger's) split the tokens too; wide: 65537 ids
# a rank, past vocab tiles and chunks of up to 65536 (Liger's 32768-wide block, Unsloth's 65536);
# deep: H = 4097, past split-K tiles. 2^k + 1 each, so every power-of-two tile leaves a tail of
# one (the reduction of a failure halves them: `verify.running.reduce`).
EXTENTS = ("small", "long", "wide", "deep")
LONG_TOKENS = 4097
WIDE_VOCAB = 65537  # a rank's ids
DEEP_HIDDEN = 4097
LONG_VOCAB = 65  # a rank's ids in a long case: > 4 H of its H = 16
EXTENT_HIDDEN = 16  # H of a long or wide case


def extent_sizes(extent: str, tp: int, vocab: int) -> dict[str, int]:
    """The size fields of a case of ``extent`` at TP degree ``tp`` (none for ``small``), keeping
    the parity of ``vocab``'s shards (an uneven one's rank 0 holds one id more)."""
    uneven = vocab % tp if tp > 1 else 0
    if extent == "long":
        return {
            "tokens": LONG_TOKENS,
            "vocab": LONG_VOCAB * tp + uneven,
            "hidden_size": EXTENT_HIDDEN,
        }
    if extent == "wide":
        return {"vocab": WIDE_VOCAB * tp + uneven, "hidden_size": EXTENT_HIDDEN}
    return {"hidden_size": DEEP_HIDDEN} if extent == "deep" else {}


# twice: retain_graph and a second backward (must give the same gradients)
GRADS = ("both", "hidden", "weight", "none", "twice")
BACKENDS = ("torch", "triton")
# lce's paths: the scalar loss's 4 GEMMs, 3 GEMMs with an fp32 buffer of its own (fast=True), 3
# GEMMs into a caller's main_grad (grad_weight_into; adapters report what main_grad gained); and
# for per-token outputs and the loss alike, the logits kept from forward to backward
# (keep_logits_bytes: 3 GEMMs, the budget exactly this rank's logits).
LOSS_PATHS = ("default", "fast", "main_grad", "kept_logits")
# How the implementation receives the weight (and bias): plain tensors (this rank's rows), a
# DTensor sharded Shard(0) over a 1-D mesh of the TP group (its rows split like torch.chunk: see
# `shard_bounds`), or a DTensor replicated on that mesh (the whole head on every rank).
DTENSOR_LAYOUTS = ("none", "shard0", "replicate")
# Invalid inputs for the status-agreement property; "none" is a valid case.
FAULTS = (
    "none",
    "target_ge_vocab",
    "target_negative",
    "temperature_zero",
    "temperature_nan",
    "hidden_size_mismatch",
    "targets_float",
    "softcap_zero",
    "smoothing_above_one",
    "bias_length",
)
# The model option each fault passes a bad value of: an implementation that does not claim the
# option never sees the fault (`verify.adapters.features`).
FAULT_OPTIONS = {
    "temperature_zero": "temperature",
    "temperature_nan": "temperature",
    "softcap_zero": "softcap",
    "smoothing_above_one": "label_smoothing",
    "bias_length": "bias",
}
# Metamorphic transforms applied by `verify.cases.build` after the base problem is drawn.
TRANSFORMS = (
    "none",
    "vocab_permute",  # weight rows permuted, targets remapped
    "unshift",  # the same problem without its common offset
    "retarget",  # other targets (same ignore mask); entropy must not change
    "perturb_ignored",  # ignored rows' hidden replaced by other values
    "fold_temperature",  # hidden / temperature with temperature 1 (power-of-two temperatures)
    "untie",  # tied case rebuilt with a separate embedding copy
    "upstream_a",  # first upstream draw alone (upstream linearity)
    "upstream_b",  # second upstream draw alone
    "upstream_mix",  # LINEARITY_A * upstream_a + upstream_b
)
LINEARITY_A = -0.75


# Fields added after specs were first saved, with their defaults (omitted from `CaseSpec.to_json`
# at them).
WRITTEN_WHEN_SET: dict[str, Any] = {
    "shards": None,
    "ignore_index": IGNORE_INDEX,
    "loss_path": "default",
    "logit_scale": 1.0,
    "softcap": None,
    "bias": 0.0,
    "z_loss": 0.0,
    "label_smoothing": 0.0,
    "dtensor": "none",
}
# The model options of the logit map and the loss (`lce.LogitOptions`, the bias beside it), each
# a spec field; `CaseSpec.logit_options` builds lce's record from them.
OPTION_FIELDS = ("temperature", "logit_scale", "softcap", "bias", "z_loss", "label_smoothing")
# Options that are terms of the loss alone (the per-token log-probs and entropy do not see them).
LOSS_OPTIONS = ("z_loss", "label_smoothing")


class SpecError(ValueError):
    """A spec field is out of its domain; the message names the field and the allowed values."""


@dataclass(frozen=True)
class CaseSpec:
    """One case. ``batch`` = 0 gives 2-D ``[tokens, H]`` inputs, ``batch`` >= 1 gives 3-D
    ``[batch, tokens, H]``. ``tp`` is the TP degree the case runs at; ``shards`` gives each rank's
    number of vocab rows (zeros allowed), None splits the vocabulary like ``numpy.array_split``
    (uneven when ``vocab % tp``; see `shard_bounds`); ``reduce_hidden=False`` leaves each
    rank's grad_hidden partial (sequence parallel). ``chunk_size`` is the torch backend's
    tokens per chunk (None: its default). ``seed`` seeds the one generator all tensors come from.
    ``ignore_index`` is the id that marks ignored targets: -100, or others real code passes (0,
    -1, a pad id inside the vocabulary, where a drawn target equal to it is ignored too).
    """

    tokens: int = 4
    hidden_size: int = 8
    vocab: int = 16
    batch: int = 0
    tp: int = 1
    hidden_dtype: str = "fp32"
    weight_dtype: str = "fp32"
    reduction: str = "mean"
    ignore: str = "none"
    target: str = "random"
    regime: str = "normal"
    scale: float = 1.0
    offset: float = 0.0
    temperature: float = 1.0
    tied: bool = False
    reduce_hidden: bool = True
    layout: str = "contiguous"
    upstream: str = "random"
    grads: str = "both"
    chunk_size: int | None = None
    backend: str = "torch"
    seed: int = 0
    fault: str = "none"
    transform: str = "none"
    shards: tuple[int, ...] | None = None
    ignore_index: int = IGNORE_INDEX
    loss_path: str = "default"
    logit_scale: float = 1.0
    softcap: float | None = None
    bias: float = 0.0
    z_loss: float = 0.0
    label_smoothing: float = 0.0
    dtensor: str = "none"

    def __post_init__(self) -> None:
        _check_choices(self)
        for name in ("tokens", "batch", "seed"):
            if getattr(self, name) < 0:
                raise SpecError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("hidden_size", "vocab", "tp"):
            if getattr(self, name) < 1:
                raise SpecError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size < 2 and self.regime in ("offset", "negative"):
            raise SpecError("regime offset/negative needs hidden_size >= 2 (a constant feature)")
        if self.vocab < self.tp:
            raise SpecError(f"vocab ({self.vocab}) must be >= tp ({self.tp}): one id per rank")
        if (self.hidden_dtype, self.weight_dtype) not in DTYPE_PAIRS:
            raise SpecError(
                f"(hidden_dtype, weight_dtype) must be one of {DTYPE_PAIRS}, "
                f"got {(self.hidden_dtype, self.weight_dtype)}"
            )
        if self.shards is not None and (
            len(self.shards) != self.tp or sum(self.shards) != self.vocab or min(self.shards) < 0
        ):
            raise SpecError(
                f"shards must be tp={self.tp} sizes >= 0 summing to vocab={self.vocab}, "
                f"got {self.shards}"
            )
        if self.loss_path == "main_grad" and self.grads == "twice":
            raise SpecError(
                "loss_path main_grad adds to main_grad on every backward: grads='twice' (two "
                "backwards compared bit for bit) does not apply"
            )
        if self.tied and self.tp != 1:
            raise SpecError("tied=True needs tp=1 (a vocab-parallel embedding is not modelled)")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise SpecError(f"chunk_size must be None or >= 1, got {self.chunk_size}")
        if not (math.isfinite(self.scale) and self.scale >= 0):
            raise SpecError(f"scale must be finite and >= 0, got {self.scale}")
        if not math.isfinite(self.offset):
            raise SpecError(f"offset must be finite, got {self.offset}")
        _check_options(self)
        _check_dtensor(self)

    @property
    def has_options(self) -> bool:
        """A model option other than the temperature is set (the plain LM head otherwise)."""
        return any(getattr(self, name) != OPTION_DEFAULTS[name] for name in OPTION_FIELDS[1:])

    def logit_options(self, temperature: float | None = None) -> LogitOptions:
        """lce's record of the spec's logit map and loss terms (``temperature``: another one,
        e.g. 1 where a transform folded it into hidden)."""
        return LogitOptions(
            temperature=self.temperature if temperature is None else temperature,
            logit_scale=self.logit_scale, softcap=self.softcap, z_loss=self.z_loss,
            label_smoothing=self.label_smoothing,
        )  # fmt: skip

    @property
    def num_tokens(self) -> int:
        """Rows of the flattened problem: ``max(batch, 1) * tokens``."""
        return max(self.batch, 1) * self.tokens

    @property
    def extent(self) -> str:
        """The dimension past real kernels' tile boundaries (`EXTENTS`), ``small`` for none:
        ``deep`` from H = `DEEP_HIDDEN`, ``wide`` from `WIDE_VOCAB` ids on every rank, ``long``
        from `LONG_TOKENS` rows."""
        if self.hidden_size >= DEEP_HIDDEN:
            return "deep"
        if min(stop - start for start, stop in self.shard_bounds()) >= WIDE_VOCAB:
            return "wide"
        return "long" if self.num_tokens >= LONG_TOKENS else "small"

    @property
    def dtype_key(self) -> str:
        """The tolerances.yaml key: ``fp32``, ``bf16``, ..., ``fp32_bf16``."""
        return dtype_key(self.hidden_dtype, self.weight_dtype)

    def target_shape(self) -> tuple[int, ...]:
        return (self.batch, self.tokens) if self.batch else (self.tokens,)

    def shard_bounds(self) -> list[tuple[int, int]]:
        """``[start, stop)`` of each rank's vocab rows at ``tp`` (a Shard(0) DTensor's:
        torch.chunk's split)."""
        if self.dtensor == "shard0":
            return shard_bounds(self.vocab, self.tp, chunk_sizes(self.vocab, self.tp))
        return shard_bounds(self.vocab, self.tp, self.shards)

    @property
    def even_shards(self) -> bool:
        """Every rank holds as many vocab rows (lce's default ``vocab_start`` then applies)."""
        return len({stop - start for start, stop in self.shard_bounds()}) == 1

    def with_(self, **changes: Any) -> CaseSpec:
        """A copy with ``changes`` (validated)."""
        return replace(self, **changes)

    def to_json(self) -> str:
        """One JSON line (keys sorted) that `from_json` turns back into an equal spec.

        Fields added later (`WRITTEN_WHEN_SET`) are written only when not at their default: specs
        saved before they existed keep their JSON (and the artifact names and fingerprints
        computed from it)."""
        data = asdict(self)
        for name, default in WRITTEN_WHEN_SET.items():
            if data[name] == default:
                del data[name]
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> CaseSpec:
        """Parse `to_json` output (or its dict); unknown keys are an error naming them."""
        data = json.loads(text) if isinstance(text, str) else dict(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"unknown CaseSpec field(s) {unknown}; known: {sorted(known)}")
        if data.get("shards") is not None:
            data["shards"] = tuple(data["shards"])
        return cls(**data)


# Each model option's default: the plain LM head.
OPTION_DEFAULTS: dict[str, Any] = {
    name: CaseSpec.__dataclass_fields__[name].default for name in OPTION_FIELDS
}


def shard_bounds(
    vocab: int, tp: int, sizes: tuple[int, ...] | None = None
) -> list[tuple[int, int]]:
    """The one shard rule: ``[start, stop)`` of each rank's vocab rows, contiguous in rank order,
    of the given ``sizes``, else sized like ``numpy.array_split`` (the first ``vocab % tp`` ranks
    get one row more)."""
    if sizes is None:
        base, extra = divmod(vocab, tp)
        sizes = tuple(base + (1 if rank < extra else 0) for rank in range(tp))
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def chunk_sizes(vocab: int, tp: int) -> tuple[int, ...]:
    """Each rank's rows under ``torch.chunk`` (DTensor's Shard(0)): ``ceil(vocab / tp)`` each
    while rows last, so the last ranks may hold fewer, or none."""
    step = -(-vocab // tp)
    return tuple(min(step, max(vocab - rank * step, 0)) for rank in range(tp))


_CHOICES = {
    "reduction": REDUCTIONS,
    "ignore": IGNORE_PATTERNS,
    "target": TARGET_PATTERNS,
    "regime": REGIMES,
    "layout": LAYOUTS,
    "upstream": UPSTREAMS,
    "grads": GRADS,
    "backend": BACKENDS,
    "fault": FAULTS,
    "transform": TRANSFORMS,
    "loss_path": LOSS_PATHS,
    "dtensor": DTENSOR_LAYOUTS,
    "hidden_dtype": tuple(DTYPES),
    "weight_dtype": tuple(DTYPES),
}


def _check_options(spec: CaseSpec) -> None:
    for name in ("temperature", "logit_scale"):
        value = getattr(spec, name)
        if not (math.isfinite(value) and value > 0):
            raise SpecError(f"{name} must be finite and > 0, got {value}")
    if spec.softcap is not None and not (math.isfinite(spec.softcap) and spec.softcap > 0):
        raise SpecError(f"softcap must be None or finite and > 0, got {spec.softcap}")
    for name in ("bias", "z_loss"):
        value = getattr(spec, name)
        if not (math.isfinite(value) and value >= 0):
            raise SpecError(f"{name} must be finite and >= 0, got {value}")
    if not 0.0 <= spec.label_smoothing <= 1.0:
        raise SpecError(f"label_smoothing must be in [0, 1], got {spec.label_smoothing}")


def _check_dtensor(spec: CaseSpec) -> None:
    """What a DTensor weight is modelled with: a plain untied head on valid inputs, the 4-GEMM or
    ``fast`` loss, torch.chunk's rows, and a replicated head's grad_hidden already whole."""
    if spec.dtensor == "none":
        return
    clashes = {
        "explicit shards (a Shard(0) DTensor's rows are torch.chunk's)": spec.shards is not None,
        "a tied embedding": spec.tied,
        "loss_path main_grad (the harness's main_grad is a plain tensor)": (
            spec.loss_path == "main_grad"
        ),
        "a fault (invalid inputs are drawn with plain weights)": spec.fault != "none",
        "a partial grad_hidden (a replicated head's is whole on every rank)": (
            spec.dtensor == "replicate" and not spec.reduce_hidden
        ),
    }
    named = [what for what, clash in clashes.items() if clash]
    if named:
        raise SpecError(f"dtensor={spec.dtensor!r} is not modelled with {'; '.join(named)}")


def _check_choices(spec: CaseSpec) -> None:
    for name, allowed in _CHOICES.items():
        value = getattr(spec, name)
        if value not in allowed:
            raise SpecError(f"{name} must be one of {allowed}, got {value!r}")
