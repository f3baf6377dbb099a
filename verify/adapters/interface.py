"""The adapter protocol: what an implementation under test computes, supports and promises.

An `Adapter` wraps one linear-cross-entropy implementation. The harness builds every case from a
`verify.cases.spec.CaseSpec`, hands the implementation a `Call`, and judges what comes back against
the
float64 reference with the tolerance entries its `NumericalContract` selects. Features the
`Capabilities` do not claim are never generated for it; `verify.adapters.features.not_tested`
lists them for the report.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lce.options import LogitOptions
from verify.cases.spec import (
    BACKENDS,
    DTENSOR_LAYOUTS,
    DTYPE_PAIRS,
    OPTION_FIELDS,
    REDUCTIONS,
    CaseSpec,
)
from verify.numerics.reference import IGNORE_INDEX

OUTPUTS = ("logprobs", "entropy", "loss")
LOGITS = ("fp32", "input")
OUTPUT_DTYPES = ("fp32", "input")
# Every pair with a tolerances.yaml entry except fp64 (few kernels take fp64; opt in with it).
DEFAULT_PAIRS = tuple(p for p in DTYPE_PAIRS if p != ("fp64", "fp64"))


class AdapterError(ValueError):
    """An adapter is malformed or cannot be loaded; the message names the field and the fix."""


@dataclass(frozen=True)
class Call:
    """One call of the implementation, for this TP rank.

    ``hidden``: ``[T, H]`` or ``[B, T, H]`` (possibly non-contiguous, possibly of another dtype
    than ``weight``: cast it like a linear layer would). ``weight``: this rank's rows
    ``[V_local, H]``; ``bias``: this rank's ``[V_local]`` LM-head bias (weight's dtype), or None.
    ``targets``: global ids shaped like ``hidden`` without its last dim; ``ignore_index`` marks
    ignored tokens. ``options``: the model options (`lce.LogitOptions`: temperature, logit scale,
    softcap, z-loss, label smoothing; the logits are ``cap * tanh(s * (h @ W.T + b) / cap) /
    T``); only those the implementation claims (`Capabilities.options`) are ever set.
    ``tp_group``/``vocab_start``: vocab parallelism (None without TP; ``vocab_start`` None means
    ``rank * V_local``). For an implementation that claims DTensor weights
    (`Capabilities.dtensor_weights`) ``weight`` and ``bias`` may be DTensors on a 1-D mesh of the
    TP group, Shard(0) (this rank's rows, split like ``torch.chunk``) or Replicate (the whole
    head): then ``tp_group`` and ``vocab_start`` are None (the mesh says both).
    ``reduce_grad_hidden`` False asks for this rank's partial grad_hidden (the harness sums the
    ranks', like a reduce-scatter). ``backend``/``chunk_size``: the spec's
    values, for implementations that claim them (`Capabilities.backends`, ``chunk_size``).
    ``loss_path``: which of lce's scalar-loss paths (`verify.cases.spec.LOSS_PATHS`); other
    implementations have one and ignore it.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    ignore_index: int = IGNORE_INDEX
    options: LogitOptions = field(default_factory=LogitOptions)
    tp_group: dist.ProcessGroup | None = None
    vocab_start: int | None = None
    reduce_grad_hidden: bool = True
    backend: str = "torch"
    chunk_size: int | None = None
    loss_path: str = "default"
    bias: torch.Tensor | None = None

    @property
    def temperature(self) -> float:
        return self.options.temperature

    @property
    def first_id(self) -> int:
        """The global id of this rank's first weight row: ``vocab_start``, which None leaves to
        be ``rank * V_local`` (lce's own default, which the harness exercises), resolved; 0
        without TP. For plain tensors: a DTensor weight's mesh says it instead."""
        if self.vocab_start is not None:
            return self.vocab_start
        if self.tp_group is None:
            return 0
        return dist.get_rank(self.tp_group) * self.weight.shape[0]


# token_outputs(call) -> {"logprobs": [..targets shape], "entropy": [..] (if claimed)}
TokenFn = Callable[[Call], Mapping[str, torch.Tensor]]
# loss(call, reduction) -> the loss; reduction in Capabilities.reductions
LossFn = Callable[[Call, str], torch.Tensor]


@dataclass(frozen=True)
class Limits:
    """Input sizes the implementation accepts (kernels assert them); no case outside them is
    generated, and the report lists them under "not tested".

    ``hidden_multiple``: H is a multiple of it. ``vocab_multiple``: every rank's vocab rows are a
    multiple of it (more than 1 implies ``even_shards``). ``min_tokens``: at least this many
    tokens (rows of the flattened ``[N, H]`` input); ``token_multiple``: their count is a
    multiple of it. ``even_shards``: at TP > 1 every rank holds ``V / tp`` rows
    (``Call.vocab_start`` is then always ``rank * V_local``).
    """

    hidden_multiple: int = 1
    vocab_multiple: int = 1
    min_tokens: int = 0
    token_multiple: int = 1
    even_shards: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_multiple", "vocab_multiple", "token_multiple"):
            if getattr(self, name) < 1:
                raise AdapterError(f"limits.{name} must be >= 1, got {getattr(self, name)}")
        if self.min_tokens < 0:
            raise AdapterError(f"limits.min_tokens must be >= 0, got {self.min_tokens}")

    def shard_multiple(self, tp: int) -> int:
        """What the global vocab must be a multiple of at TP degree ``tp`` (1: anything goes)."""
        even = self.even_shards or self.vocab_multiple > 1
        return self.vocab_multiple * (tp if even else 1)

    def fit(self, spec: CaseSpec) -> CaseSpec:
        """``spec`` with H, V and the token count rounded up into the limits (vocab shards then
        split evenly when the limits ask for it)."""
        rows = max(spec.batch, 1)
        tokens = max(spec.tokens, -(-self.min_tokens // rows))
        changes = {
            "hidden_size": _round_up(spec.hidden_size, self.hidden_multiple),
            # rows x tokens flattened: tokens a multiple of what the batch rows do not supply
            "tokens": _round_up(tokens, self.token_multiple // math.gcd(self.token_multiple, rows)),
        }
        if self._shard_violation(spec):
            changes["vocab"] = _round_up(spec.vocab, self.shard_multiple(spec.tp))
            changes["shards"] = None
        changed = {k: v for k, v in changes.items() if v != getattr(spec, k)}
        return spec.with_(**changed) if changed else spec

    def violations(self, spec: CaseSpec) -> list[str]:
        """Which limits ``spec`` breaks (empty when it fits)."""
        out = []
        if spec.hidden_size % self.hidden_multiple:
            out.append(f"hidden_size {spec.hidden_size} % {self.hidden_multiple} != 0")
        if self._shard_violation(spec):
            out.append(f"vocab shards {[b - a for a, b in spec.shard_bounds()]} not equal "
                       f"multiples of {self.vocab_multiple}")  # fmt: skip
        if spec.num_tokens < self.min_tokens:
            out.append(f"{spec.num_tokens} tokens < min_tokens {self.min_tokens}")
        if spec.num_tokens % self.token_multiple:
            out.append(f"{spec.num_tokens} tokens % {self.token_multiple} != 0")
        return out

    def _shard_violation(self, spec: CaseSpec) -> bool:
        sizes = [stop - start for start, stop in spec.shard_bounds()]
        even = self.even_shards or self.vocab_multiple > 1
        return any(n % self.vocab_multiple for n in sizes) or (even and not spec.even_shards)

    def lines(self) -> list[str]:
        """The declared limits, one phrase each (for "not tested")."""
        out = []
        if self.hidden_multiple > 1:
            out.append(f"hidden_size not a multiple of {self.hidden_multiple}")
        if self.vocab_multiple > 1:
            out.append(f"vocab rows per rank not a multiple of {self.vocab_multiple}")
        if self.even_shards or self.vocab_multiple > 1:
            out.append("uneven vocab shards (ranks holding different row counts)")
        if self.min_tokens > 0:
            out.append(f"fewer than {self.min_tokens} tokens")
        if self.token_multiple > 1:
            out.append(f"token count not a multiple of {self.token_multiple}")
        return out


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Capabilities:
    """Which features an implementation supports; everything else is not generated for it.

    ``reductions``: loss reductions (``mean`` is over non-ignored tokens). ``ignore_index``:
    honours ``Call.ignore_index`` (ignored tokens give 0 outputs and 0 gradients).
    ``options``: the model options it honours, of `verify.cases.spec.OPTION_FIELDS`
    (``temperature``, ``logit_scale``, ``softcap``, ``bias``, ``z_loss``, ``label_smoothing``:
    ``Call.options`` and ``Call.bias``); the others stay at their defaults. ``tensor_parallel``:
    works on a vocab shard with ``Call.tp_group``. ``dtype_pairs``: ``(hidden, weight)`` dtype
    names, mixed pairs included. ``batched``: accepts 3-D hidden. ``strided``: accepts
    non-contiguous hidden/weight. ``empty``: accepts T = 0. ``frozen``: gradients when only one of
    hidden/weight requires grad, and no-grad calls. ``tied``: the weight may also be an embedding
    (gradients add up through autograd). ``chunk_size``: honours ``Call.chunk_size`` (the result
    must not depend on it). ``backends``: values of ``Call.backend`` it distinguishes.
    ``deterministic``: claims bit-identical reruns. ``validates_inputs``: raises on invalid input
    (target out of range, temperature <= 0, shape mismatch) naming the argument. ``loss_paths``:
    values of ``Call.loss_path`` it distinguishes (``main_grad``: its loss adds the weight
    gradient into a caller's buffer, checked by the main_grad property). ``double_backward``: the
    backends on which a backward with ``create_graph=True`` works (without TP, default loss path),
    every other one refusing it with an error naming double backward and ``create_graph``; None
    claims no such contract (the double_backward property). ``compiles``: the backends on which
    its callables work under ``torch.compile(fullgraph=True)`` (no graph break) and give what
    they give in eager (the compiled property). ``graph_capture``: the backends on which one
    forward and backward can be captured in a CUDA graph and replayed with new inputs copied in,
    giving eager's results bit for bit (the graph_replay property, on CUDA).
    ``dtensor_weights``: the DTensor layouts of the weight (and bias) it takes, of ``shard0``
    (vocab-parallel over the mesh's group) and ``replicate`` (local): each gives, bit for bit,
    what the plain tensors it implies give (Shard(0): the local rows with the mesh's group and
    the shard's offset as ``vocab_start``; Replicate: the whole weight without TP), and the
    gradients come back as DTensors of the leaf's mesh and placements (the dtensor property).
    ``limits``: the sizes it accepts (`Limits`).
    """

    reductions: tuple[str, ...] = REDUCTIONS
    ignore_index: bool = True
    options: tuple[str, ...] = ()
    tensor_parallel: bool = False
    dtype_pairs: tuple[tuple[str, str], ...] = DEFAULT_PAIRS
    batched: bool = True
    strided: bool = True
    empty: bool = True
    frozen: bool = True
    tied: bool = True
    chunk_size: bool = False
    backends: tuple[str, ...] = ("torch",)
    deterministic: bool = False
    validates_inputs: bool = False
    loss_paths: tuple[str, ...] = ("default",)
    double_backward: tuple[str, ...] | None = None
    compiles: tuple[str, ...] = ()
    graph_capture: tuple[str, ...] = ()
    dtensor_weights: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        _subset("reductions", self.reductions, REDUCTIONS)
        _subset("options", self.options, OPTION_FIELDS)
        _subset("backends", self.backends, BACKENDS)
        _subset("double_backward", self.double_backward or (), BACKENDS)
        _subset("compiles", self.compiles, BACKENDS)
        _subset("graph_capture", self.graph_capture, BACKENDS)
        _subset("dtensor_weights", self.dtensor_weights, DTENSOR_LAYOUTS[1:])
        _subset("dtype_pairs", self.dtype_pairs, DTYPE_PAIRS)
        if not self.reductions or not self.dtype_pairs or not self.backends:
            raise AdapterError("reductions, dtype_pairs and backends each need at least one value")


@dataclass(frozen=True)
class NumericalContract:
    """How precisely the implementation computes, which selects its tolerance entries.

    ``logits``: ``"fp32"`` (fp32 accumulation, logits never rounded to the input dtype, like lce)
    or ``"input"`` (logits rounded to the input dtype before an fp32 softmax, the stock path).
    ``outputs``: dtype of logprobs/entropy/loss: ``"fp32"`` (lce's contract) or ``"input"`` (the
    input dtype, or fp32; the harness upcasts them exactly and grants their one rounding,
    `verify.properties.verdict.returned_rounding`). Both ``logits`` contracts are judged by the
    same tolerances.yaml entries (the low-precision ones were set for the stock path, which rounds
    its logits, and bound an fp32-logits kernel from above).
    """

    logits: str = "fp32"
    outputs: str = "fp32"

    def __post_init__(self) -> None:
        if self.logits not in LOGITS:
            raise AdapterError(f"contract.logits must be one of {LOGITS}, got {self.logits!r}")
        if self.outputs not in OUTPUT_DTYPES:
            raise AdapterError(
                f"contract.outputs must be one of {OUTPUT_DTYPES}, got {self.outputs!r}"
            )


@dataclass(frozen=True)
class Adapter:
    """One implementation under test.

    ``name``: short label for reports. ``token_outputs`` and ``loss``: how it is called (either
    may be None; at least one is given). ``outputs``: which of ``logprobs``, ``entropy``, ``loss``
    it computes (``entropy`` needs ``token_outputs``). ``device``: where its inputs live
    (``"cpu"``, ``"cuda"``) when it runs in the driver (a pool worker uses its own device).
    ``ref``: how another process finds it (a registry name or ``module:function``);
    `verify.adapters.resolve` fills it in. ``refusals``: the exceptions that mean "refused the
    input" (judged by the status property); any other exception propagates as a harness error.
    """

    name: str
    outputs: tuple[str, ...]
    token_outputs: TokenFn | None = None
    loss: LossFn | None = None
    capabilities: Capabilities = field(default_factory=Capabilities)
    contract: NumericalContract = field(default_factory=NumericalContract)
    device: str = "cpu"
    description: str = ""
    ref: str = ""
    # Properties that say nothing about this implementation, with the reason (for the report).
    skip: tuple[tuple[str, str], ...] = ()
    # Third-party code may raise anything on an input it does not take.
    refusals: tuple[type[Exception], ...] = (Exception,)

    def __post_init__(self) -> None:
        _subset("outputs", self.outputs, OUTPUTS)
        token = {"logprobs", "entropy"} & set(self.outputs)
        if token and self.token_outputs is None:
            raise AdapterError(
                f"{self.name}: outputs {sorted(token)} need a token_outputs callable"
            )
        if "logprobs" not in self.outputs and self.token_outputs is not None:
            raise AdapterError(f"{self.name}: token_outputs must return at least 'logprobs'")
        if ("loss" in self.outputs) != (self.loss is not None):
            raise AdapterError(f"{self.name}: declare 'loss' in outputs exactly when loss is given")
        if not self.outputs:
            raise AdapterError(f"{self.name}: outputs is empty; declare what it computes")

    def label(self, backend: str) -> str:
        """``name``, with the spec's backend when the implementation has several."""
        return f"{self.name}-{backend}" if len(self.capabilities.backends) > 1 else self.name


def _subset(name: str, values: tuple, allowed: tuple) -> None:
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise AdapterError(f"{name} has unknown value(s) {unknown}; allowed: {allowed}")
