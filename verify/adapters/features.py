"""The case features an implementation may or may not claim, one record each.

A `Feature` says how to tell from an adapter whether it claims the feature, how a spec leaves the
feature out, and how the report names it when it is not tested. `coerce` maps every drawn spec
into what the adapter claims (mapping, not filtering: Hypothesis never starves, and failures still
shrink); `unclaimed` lists what that leaves untested. Adding a capability is adding a record here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verify.adapters.interface import Adapter
from verify.cases.spec import (
    DTENSOR_LAYOUTS,
    DTYPE_PAIRS,
    FAULT_OPTIONS,
    OPTION_DEFAULTS,
    OPTION_FIELDS,
    REDUCTIONS,
    CaseSpec,
)
from verify.numerics.reference import IGNORE_INDEX


@dataclass(frozen=True)
class Untested:
    """A feature or property not exercised for an adapter, and why."""

    what: str
    reason: str

    def line(self) -> str:
        return f"{self.what}: {self.reason}"


@dataclass(frozen=True)
class Feature:
    """``claimed(adapter)``: the adapter supports it; ``leave_out(spec, adapter)``: the spec
    changes that keep a case inside what the adapter supports (empty when already inside)."""

    what: str
    claimed: Callable[[Adapter], bool]
    leave_out: Callable[[CaseSpec, Adapter], dict[str, Any]]


def _flag(name: str) -> Callable[[Adapter], bool]:
    return lambda adapter: bool(getattr(adapter.capabilities, name))


def _always(changes: dict[str, Any]) -> Callable[[CaseSpec, Adapter], dict[str, Any]]:
    return lambda spec, adapter: changes


def _option(name: str) -> Callable[[Adapter], bool]:
    return lambda adapter: name in adapter.capabilities.options


def _without_option(name: str) -> Callable[[CaseSpec, Adapter], dict[str, Any]]:
    """The option at its default; a fault passing a bad value of it becomes a bad target id."""

    def leave_out(spec: CaseSpec, adapter: Adapter) -> dict[str, Any]:
        changes: dict[str, Any] = {name: OPTION_DEFAULTS[name]}
        if FAULT_OPTIONS.get(spec.fault) == name:
            changes["fault"] = "target_ge_vocab"
        return changes

    return leave_out


# How the report names each model option an implementation does not claim.
OPTION_GAPS = {
    "temperature": "temperature != 1",
    "logit_scale": "logit scale (logit_scale != 1)",
    "softcap": "final-logit softcapping (softcap)",
    "bias": "LM-head bias",
    "z_loss": "z-loss",
    "label_smoothing": "label smoothing",
}


def _reduction(spec: CaseSpec, adapter: Adapter) -> dict[str, Any]:
    claimed = adapter.capabilities.reductions
    if spec.reduction in claimed:
        return {}
    return {"reduction": claimed[REDUCTIONS.index(spec.reduction) % len(claimed)]}


def _dtype_pair(spec: CaseSpec, adapter: Adapter) -> dict[str, Any]:
    claimed = adapter.capabilities.dtype_pairs
    if (spec.hidden_dtype, spec.weight_dtype) in claimed:
        return {}
    return dict(zip(("hidden_dtype", "weight_dtype"), claimed[0], strict=True))


def _dtensor(spec: CaseSpec, adapter: Adapter) -> dict[str, Any]:
    """A layout the adapter does not take becomes plain tensors."""
    taken = ("none", *adapter.capabilities.dtensor_weights)
    return {} if spec.dtensor in taken else {"dtensor": "none"}


def _missing_dtensor_layouts(adapter: Adapter) -> list[str]:
    return [d for d in DTENSOR_LAYOUTS[1:] if d not in adapter.capabilities.dtensor_weights]


def _missing_reductions(adapter: Adapter) -> list[str]:
    return [r for r in REDUCTIONS if r not in adapter.capabilities.reductions]


def _missing_pairs(adapter: Adapter) -> list[str]:
    claimed = adapter.capabilities.dtype_pairs
    return [f"{h}x{w}" for h, w in DTYPE_PAIRS if (h, w) not in claimed]


FEATURES: tuple[Feature, ...] = (
    Feature("ignore_index", _flag("ignore_index"),
            _always({"ignore": "none", "ignore_index": IGNORE_INDEX})),
    *(
        Feature(OPTION_GAPS[name], _option(name), _without_option(name))
        for name in OPTION_FIELDS
    ),
    Feature("3-D [B, T, H] inputs", _flag("batched"), _always({"batch": 0})),
    Feature("non-contiguous inputs", _flag("strided"), _always({"layout": "contiguous"})),
    Feature("T = 0", _flag("empty"),
            lambda spec, adapter: {"tokens": 1} if spec.tokens == 0 else {}),
    Feature("frozen hidden/weight and no-grad calls", _flag("frozen"),
            lambda spec, adapter: {} if spec.grads in ("both", "twice") else {"grads": "both"}),
    Feature("tied embedding weights", _flag("tied"), _always({"tied": False})),
    Feature("chunk sizes", _flag("chunk_size"), _always({"chunk_size": None})),
    Feature("partial grad_hidden (sequence parallel)", _flag("tensor_parallel"),
            _always({"reduce_hidden": True})),
    # Without entropy, R's gradients carry no entropy term either.
    Feature("entropy (and its upstream patterns)", lambda a: "entropy" in a.outputs,
            _always({"upstream": "logprob_only"})),
    Feature("reductions", lambda a: not _missing_reductions(a), _reduction),
    Feature("dtype pairs", lambda a: not _missing_pairs(a), _dtype_pair),
    Feature("DTensor weights", lambda a: not _missing_dtensor_layouts(a), _dtensor),
)  # fmt: skip


def coerce(adapter: Adapter, spec: CaseSpec) -> CaseSpec:
    """``spec`` with every unclaimed feature left out and its sizes fit into the adapter's
    `Limits`."""
    changes: dict[str, Any] = {}
    for feature in FEATURES:
        if not feature.claimed(adapter):
            changes.update(feature.leave_out(spec, adapter))
    changed = {k: v for k, v in changes.items() if getattr(spec, k) != v}
    return adapter.capabilities.limits.fit(spec.with_(**changed) if changed else spec)


def unclaimed(adapter: Adapter, tp_sizes: tuple[int, ...]) -> list[Untested]:
    """Every feature ``adapter`` leaves untested here, with the reason, for the report."""
    reason = "not claimed by the adapter"
    gaps = []
    for feature in FEATURES:
        if feature.claimed(adapter):
            continue
        what = feature.what
        if feature.what == "reductions":
            what = f"reductions {_missing_reductions(adapter)}"
        elif feature.what == "dtype pairs":
            what = f"dtype pairs {_missing_pairs(adapter)}"
        elif feature.what == "DTensor weights":
            what = f"DTensor weights {_missing_dtensor_layouts(adapter)}"
        gaps.append(Untested(what, reason))
    gaps += [
        Untested(what, "outside the declared limits")
        for what in adapter.capabilities.limits.lines()
    ]
    if not adapter.capabilities.tensor_parallel:
        gaps.append(Untested("tensor parallelism", reason))
    elif max(tp_sizes) == 1:
        gaps.append(Untested("tensor parallelism", "TP = 1 only in this run (--tp)"))
    if "logprobs" not in adapter.outputs:
        gaps.append(Untested("per-token log-probs", "not computed by the implementation"))
    if adapter.contract.outputs == "input":
        gaps.append(Untested("fp32 output dtype", "the contract allows input-dtype outputs"))
    return gaps
