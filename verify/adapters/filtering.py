"""What to generate and check for an adapter, and what that leaves untested.

`specs_for` draws the engine's `case_specs` and maps every feature the adapter does not claim to a
value it supports (mapping, not filtering: Hypothesis never starves, and failures still shrink).
`properties_for` keeps the properties that apply; `not_tested` says what was left out and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from hypothesis import strategies as st

from verify.cases.spec import DTYPE_PAIRS, REDUCTIONS, CaseSpec
from verify.cases.strategies import case_specs, invalid_specs
from verify.execution.interface import Adapter
from verify.properties.catalog import PROPERTIES
from verify.properties.status import available_backends


@dataclass(frozen=True)
class Untested:
    """A feature or property not exercised for an adapter, and why."""

    what: str
    reason: str

    def line(self) -> str:
        return f"{self.what}: {self.reason}"


def backends_for(adapter: Adapter) -> tuple[str, ...]:
    """The adapter's backends runnable here; the error says what is missing."""
    usable = tuple(b for b in adapter.capabilities.backends if b in available_backends())
    if not usable:
        raise ValueError(
            f"{adapter.name}: none of its backends {adapter.capabilities.backends} runs here "
            "(triton needs CUDA or TRITON_INTERPRET=1)"
        )
    return usable


def coerce(adapter: Adapter, spec: CaseSpec) -> CaseSpec:
    """``spec`` with every unclaimed feature replaced by a supported value."""
    caps, changes = adapter.capabilities, {}
    if spec.reduction not in caps.reductions:
        index = REDUCTIONS.index(spec.reduction) % len(caps.reductions)
        changes["reduction"] = caps.reductions[index]
    if (spec.hidden_dtype, spec.weight_dtype) not in caps.dtype_pairs:
        changes["hidden_dtype"], changes["weight_dtype"] = caps.dtype_pairs[0]
    if not caps.ignore_index:
        changes["ignore"], changes["ignore_index"] = "none", -100
    if not caps.temperature:
        changes["temperature"] = 1.0
    if not caps.batched:
        changes["batch"] = 0
    if not caps.strided:
        changes["layout"] = "contiguous"
    if not caps.empty and spec.tokens == 0:
        changes["tokens"] = 1
    if not caps.frozen and spec.grads != "twice":
        changes["grads"] = "both"
    if not caps.tied:
        changes["tied"] = False
    if not caps.chunk_size:
        changes["chunk_size"] = None
    if not caps.tensor_parallel:
        changes["reduce_hidden"] = True
    if "entropy" not in adapter.outputs:
        changes["upstream"] = "logprob_only"  # R's gradients then carry no entropy term either
    return caps.limits.fit(spec.with_(**changes) if changes else spec)


def specs_for(
    adapter: Adapter, tp_sizes: tuple[int, ...] = (1,), max_tokens: int = 24
) -> st.SearchStrategy[CaseSpec]:
    """Valid specs within the adapter's capabilities, at ``tp_sizes`` (TP > 1 only if claimed)."""
    caps = adapter.capabilities
    tps = tuple(t for t in tp_sizes if t == 1 or caps.tensor_parallel)
    specs = case_specs(
        backends=backends_for(adapter), tp_sizes=tps, pairs=caps.dtype_pairs, max_tokens=max_tokens
    )
    return specs.map(partial(coerce, adapter))


def invalid_specs_for(adapter: Adapter) -> st.SearchStrategy[CaseSpec]:
    """Faulty specs for the status property (only for adapters that claim input validation)."""
    return (
        invalid_specs()
        .map(partial(coerce, adapter))
        .map(lambda s: s.with_(tokens=max(s.tokens, 1)))
    )


def properties_for(adapter: Adapter, tp_sizes: tuple[int, ...] = (1,)) -> tuple[str, ...]:
    """The registered properties that say something about ``adapter`` (see `not_tested`)."""
    skipped = {u.what.removeprefix("property ") for u in _property_gaps(adapter, tp_sizes)}
    return tuple(name for name in PROPERTIES if name not in skipped)


def not_tested(adapter: Adapter, tp_sizes: tuple[int, ...] = (1,)) -> list[Untested]:
    """Every feature and property left out for ``adapter``, with the reason, for the report."""
    return _feature_gaps(adapter, tp_sizes) + _property_gaps(adapter, tp_sizes)


def _feature_gaps(adapter: Adapter, tp_sizes: tuple[int, ...]) -> list[Untested]:
    caps = adapter.capabilities
    unclaimed = "not claimed by the adapter"
    gaps = [Untested("bias", "the harness generates bias-free heads only")]
    flags = {
        "ignore_index": caps.ignore_index, "temperature != 1": caps.temperature,
        "3-D [B, T, H] inputs": caps.batched, "non-contiguous inputs": caps.strided,
        "T = 0": caps.empty, "frozen hidden/weight and no-grad calls": caps.frozen,
        "tied embedding weights": caps.tied,
    }  # fmt: skip
    gaps += [Untested(what, unclaimed) for what, ok in flags.items() if not ok]
    gaps += [Untested(what, "outside the declared limits") for what in caps.limits.lines()]
    missing = [r for r in REDUCTIONS if r not in caps.reductions]
    if missing:
        gaps.append(Untested(f"reductions {missing}", unclaimed))
    pairs = [f"{h}x{w}" for h, w in DTYPE_PAIRS if (h, w) not in caps.dtype_pairs]
    if pairs:
        gaps.append(Untested(f"dtype pairs {pairs}", unclaimed))
    if not caps.tensor_parallel:
        gaps.append(Untested("tensor parallelism", unclaimed))
    elif max(tp_sizes) == 1:
        gaps.append(Untested("tensor parallelism", "no worker pool given (TP = 1 only)"))
    if "entropy" not in adapter.outputs:
        gaps.append(Untested("entropy", "not computed by the implementation"))
        gaps.append(Untested("upstream patterns", "per-token log-prob upstreams are random only"))
    if "logprobs" not in adapter.outputs:
        gaps.append(Untested("per-token log-probs", "not computed by the implementation"))
    if adapter.contract.outputs == "input":
        gaps.append(Untested("fp32 output dtype", "the contract allows input-dtype outputs"))
    return gaps


def _property_gaps(adapter: Adapter, tp_sizes: tuple[int, ...]) -> list[Untested]:
    caps, outputs = adapter.capabilities, set(adapter.outputs)
    reasons = dict(adapter.skip)
    needs = {
        "tp_invariance": (caps.tensor_parallel and max(tp_sizes) > 1, "needs TP and a pool"),
        "megatron_peer": (caps.tensor_parallel and max(tp_sizes) > 1, "needs TP and a pool"),
        "chunk_invariance": (caps.chunk_size, "no chunk size to vary"),
        "entropy_targets": ("entropy" in outputs, "no entropy output"),
        "reduction": (
            {"logprobs", "loss"} <= outputs and adapter.contract.outputs == "fp32",
            "needs fp32 log-probs and loss (its bound is an fp32 sum's rounding)",
        ),
        "torch_peer": ("loss" in outputs, "no loss output"),
        "temperature": (caps.temperature, "temperature not claimed"),
        "ignored_rows": (caps.ignore_index, "ignore_index not claimed"),
        "tied_untied": (caps.tied, "tied weights not claimed"),
        "determinism": (caps.deterministic, "bit-identical reruns not claimed"),
        "status": (caps.validates_inputs, "input validation not claimed"),
        "double_backward": (adapter.name == "lce", "lce's own create_graph contract"),
        "main_grad": ("main_grad" in caps.loss_paths, "no main_grad loss path claimed"),
    }
    for name, (ok, reason) in needs.items():
        if not ok:
            reasons.setdefault(name, reason)
    return [Untested(f"property {name}", reason) for name, reason in reasons.items()]
