"""Every property by name, with everything about it declared once (the OpInfo way): its check,
which specs it says something about, what an implementation must claim for it to apply, the extra
runs (transforms) it makes, and whether the mutation self-test uses it.

`applicable` derives, for an adapter, the properties to search and the "not tested" list;
`verify.running.engine.check_case` calls a property's check only on specs it `applies` to.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from verify.adapters.features import Untested
from verify.adapters.interface import Adapter
from verify.cases.spec import EXTENTS, CaseSpec
from verify.execution.runner import Runner
from verify.properties import (
    compiled,
    differential,
    double_backward,
    dtensor_weights,
    graph_replay,
    main_grad,
    metamorphic,
    peers,
    status,
)
from verify.properties.verdict import PropertyVerdict

Check = Callable[[CaseSpec, Runner], list[PropertyVerdict]]


@dataclass(frozen=True)
class Need:
    """What an implementation must offer for a property to say anything about it."""

    holds: Callable[[Adapter, tuple[int, ...]], bool]
    reason: str  # why the property is not tested when it does not hold


@dataclass(frozen=True)
class Property:
    """``applies(spec)``: the property has something to check on this (valid) spec; ``faults``:
    it checks invalid specs (``spec.fault != "none"``) instead of valid ones."""

    name: str
    family: str  # differential | metamorphic | peer | status
    check: Check
    applies: Callable[[CaseSpec], bool] = lambda spec: True
    needs: tuple[Need, ...] = ()
    transforms: tuple[str, ...] = ()  # the related cases it runs (`CaseSpec.transform`)
    selftest: bool = True  # searched by the mutation self-test (`verify.running.selftest`)
    faults: bool = False
    device: str | None = None  # the workers' device type it needs ("cuda"), None for any
    # The extents (`verify.cases.spec.EXTENTS`) it judges: a large case is run once, by the
    # properties that hold that run to R (at its TP degree too); the relations between runs
    # (TP = 1 against TP = n included) stay on small cases, where each rerun costs little.
    extents: tuple[str, ...] = ("small",)

    @property
    def doc(self) -> str:
        return (self.check.__doc__ or "").strip().splitlines()[0]

    def gap(self, adapter: Adapter, tp_sizes: tuple[int, ...], device: str) -> str | None:
        """Why the property says nothing about ``adapter`` at ``tp_sizes`` on ``device`` workers
        (None: it applies)."""
        declared = dict(adapter.skip).get(self.name)
        if declared is not None:
            return declared
        unmet = next((n.reason for n in self.needs if not n.holds(adapter, tp_sizes)), None)
        if unmet is None and self.device not in (None, device):
            unmet = f"needs {self.device} workers (--device {self.device}; the GPU nightly runs it)"
        return unmet

    def covers(self, spec: CaseSpec) -> bool:
        """The property checks ``spec``: valid or faulty as it expects, of an extent it judges,
        and it applies."""
        valid = (spec.fault != "none") == self.faults
        return valid and spec.extent in self.extents and self.applies(spec)


def _claims(name: str, reason: str) -> Need:
    return Need(lambda adapter, tps: bool(getattr(adapter.capabilities, name)), reason)


def _outputs(*names: str) -> Need:
    return Need(lambda adapter, tps: set(names) <= set(adapter.outputs), f"no {names[0]} output")


TP = Need(lambda a, tps: a.capabilities.tensor_parallel and max(tps) > 1, "needs TP and a pool")
# What this environment lacks (reported as not tested, never as pairs reached or not).
TORCH_PEER = Need(lambda a, tps: peers.torch_has_peer(), "PyTorch < 2.13: no linear_cross_entropy")
MEGATRON = Need(lambda a, tps: peers.megatron_installed(), "megatron-core is not installed")


def _claims_option(name: str) -> Need:
    return Need(lambda adapter, tps: name in adapter.capabilities.options, f"{name} not claimed")


def _power_of_two_temperature(spec: CaseSpec) -> bool:
    """T = 2^k, untied, and a map that folding ``1 / T`` into hidden leaves alone (no cap, whose
    tanh sees ``a`` before ``/ T``; no bias, which hidden's scaling does not reach)."""
    mantissa, _ = math.frexp(spec.temperature)
    linear = spec.softcap is None and spec.bias == 0.0
    return spec.temperature != 1.0 and mantissa == 0.5 and not spec.tied and linear


def _common_offset_cancels(spec: CaseSpec) -> bool:
    """A shifted regime whose common logit offset changes nothing: untied (the embedding feeds
    weight's offset column into hidden), no cap (the tanh bends the offset) and no z-loss (its
    ``lse^2`` moves with it)."""
    shifted = spec.regime in ("offset", "negative") and not spec.tied
    return shifted and spec.softcap is None and spec.z_loss == 0.0


def _loss_is_minus_logprob(spec: CaseSpec) -> bool:
    return spec.z_loss == 0.0 and spec.label_smoothing == 0.0


PROPERTIES: dict[str, Property] = {
    p.name: p
    for p in (
        Property("differential", "differential", differential.differential, extents=EXTENTS),
        Property("contract", "differential", differential.contract, extents=EXTENTS),
        Property(
            "double_backward", "differential", double_backward.double_backward,
            applies=lambda s: s.tp == 1 and s.dtensor == "none",
            needs=(Need(lambda a, tps: a.capabilities.double_backward is not None,
                        "no double-backward contract claimed"),),
            selftest=False,
        ),
        Property(
            "tp_invariance", "metamorphic", metamorphic.tp_invariance,
            applies=lambda s: s.tp > 1, needs=(TP,),
        ),
        Property(
            "chunk_invariance", "metamorphic", metamorphic.chunk_invariance,
            applies=lambda s: s.backend == "torch" and s.num_tokens >= 2,
            needs=(_claims("chunk_size", "no chunk size to vary"),),
        ),
        Property(
            "vocab_permutation", "metamorphic", metamorphic.vocab_permutation,
            applies=lambda s: s.vocab >= 2, transforms=("vocab_permute",),
        ),
        Property(
            "shift_invariance", "metamorphic", metamorphic.shift_invariance,
            applies=_common_offset_cancels, transforms=("unshift",),
        ),
        Property(
            "entropy_targets", "metamorphic", metamorphic.entropy_target_independence,
            needs=(_outputs("entropy"),), transforms=("retarget",),
        ),
        Property(
            "upstream_linearity", "metamorphic", metamorphic.upstream_linearity,
            applies=lambda s: s.grads != "none",
            transforms=metamorphic.LINEARITY_RUNS,
        ),
        Property(
            "ignored_rows", "metamorphic", metamorphic.ignored_rows_irrelevant,
            applies=lambda s: s.ignore != "none" and s.num_tokens > 0,
            needs=(_claims("ignore_index", "ignore_index not claimed"),),
            transforms=("perturb_ignored",),
        ),
        Property(
            "tied_untied", "metamorphic", metamorphic.tied_untied,
            applies=lambda s: s.tied and s.grads in ("both", "twice"),
            needs=(_claims("tied", "tied weights not claimed"),), transforms=("untie",),
        ),
        Property(
            "temperature", "metamorphic", metamorphic.temperature_equivariance,
            applies=_power_of_two_temperature,
            needs=(_claims_option("temperature"),),
            transforms=("fold_temperature",),
        ),
        Property(
            "reduction", "metamorphic", metamorphic.reduction_consistency,
            applies=_loss_is_minus_logprob,
            needs=(Need(
                lambda a, tps: {"logprobs", "loss"} <= set(a.outputs)
                and a.contract.outputs == "fp32",
                "needs fp32 log-probs and loss (its bound is an fp32 sum's rounding)",
            ),),
        ),
        Property(
            "determinism", "metamorphic", metamorphic.determinism,
            needs=(_claims("deterministic", "bit-identical reruns not claimed"),), selftest=False,
        ),
        Property(
            "torch_peer", "peer", peers.torch_peer, applies=peers.torch_peer_applies,
            needs=(_outputs("loss"), TORCH_PEER), selftest=False,
        ),
        Property(
            "megatron_peer", "peer", peers.megatron_peer, applies=peers.megatron_peer_applies,
            needs=(TP, MEGATRON), selftest=False,
        ),
        Property(
            "dtensor", "metamorphic", dtensor_weights.dtensor_weights,
            applies=dtensor_weights.applies,
            needs=(Need(lambda a, tps: bool(a.capabilities.dtensor_weights),
                        "DTensor weights not claimed"),),
        ),
        Property(
            "status", "status", status.status_agreement,
            needs=(_claims("validates_inputs", "input validation not claimed"),),
            selftest=False, faults=True,
        ),
        Property(
            "main_grad", "differential", main_grad.main_grad_accumulation,
            applies=lambda s: s.dtensor == "none",  # a DTensor case has no main_grad path
            needs=(Need(lambda a, tps: "main_grad" in a.capabilities.loss_paths,
                        "no main_grad loss path claimed"),),
            selftest=False,
        ),
        Property(
            "compiled", "differential", compiled.compiled, applies=compiled.applies,
            needs=(Need(lambda a, tps: bool(a.capabilities.compiles),
                        "torch.compile support not claimed"),),
            selftest=False,
        ),
        Property(
            "graph_replay", "differential", graph_replay.graph_replay,
            applies=graph_replay.applies,
            needs=(Need(lambda a, tps: bool(a.capabilities.graph_capture),
                        "CUDA-graph capture not claimed"),),
            selftest=False, device="cuda",
        ),
    )
}  # fmt: skip


def get(name: str) -> Property:
    """The property called ``name``; the error lists the known names."""
    if name not in PROPERTIES:
        raise ValueError(f"unknown property {name!r}; known: {', '.join(PROPERTIES)}")
    return PROPERTIES[name]


def applicable(
    adapter: Adapter, tp_sizes: tuple[int, ...], names: tuple[str, ...] = (), device: str = "cpu"
) -> tuple[tuple[str, ...], list[Untested]]:
    """The properties (of ``names``, default all) that say something about ``adapter`` at
    ``tp_sizes`` on ``device`` workers, and those that do not, with the reason."""
    chosen, untested = [], []
    for name in names or tuple(PROPERTIES):
        gap = get(name).gap(adapter, tp_sizes, device)
        if gap is None:
            chosen.append(name)
        else:
            untested.append(Untested(f"property {name}", gap))
    return tuple(chosen), untested


SELFTEST_PROPERTIES = tuple(name for name, p in PROPERTIES.items() if p.selftest)
