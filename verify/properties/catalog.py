"""Every property by name: its family and its check ``(spec, runner) -> list[PropertyVerdict]``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from verify.cases.spec import CaseSpec
from verify.execution.runner import Runner
from verify.properties import (
    differential,
    double_backward,
    main_grad,
    metamorphic,
    peers,
    status,
)
from verify.properties.verdict import PropertyVerdict

Check = Callable[[CaseSpec, Runner], list[PropertyVerdict]]


@dataclass(frozen=True)
class Property:
    name: str
    family: str  # differential | metamorphic | peer | status
    check: Check
    doc: str


def _entry(name: str, family: str, check: Check) -> Property:
    return Property(name, family, check, (check.__doc__ or "").strip().splitlines()[0])


PROPERTIES: dict[str, Property] = {
    p.name: p
    for p in (
        _entry("differential", "differential", differential.differential),
        _entry("contract", "differential", differential.contract),
        _entry("double_backward", "differential", double_backward.double_backward),
        _entry("tp_invariance", "metamorphic", metamorphic.tp_invariance),
        _entry("chunk_invariance", "metamorphic", metamorphic.chunk_invariance),
        _entry("vocab_permutation", "metamorphic", metamorphic.vocab_permutation),
        _entry("shift_invariance", "metamorphic", metamorphic.shift_invariance),
        _entry("entropy_targets", "metamorphic", metamorphic.entropy_target_independence),
        _entry("upstream_linearity", "metamorphic", metamorphic.upstream_linearity),
        _entry("ignored_rows", "metamorphic", metamorphic.ignored_rows_irrelevant),
        _entry("tied_untied", "metamorphic", metamorphic.tied_untied),
        _entry("temperature", "metamorphic", metamorphic.temperature_equivariance),
        _entry("reduction", "metamorphic", metamorphic.reduction_consistency),
        _entry("determinism", "metamorphic", metamorphic.determinism),
        _entry("torch_peer", "peer", peers.torch_peer),
        _entry("megatron_peer", "peer", peers.megatron_peer),
        _entry("status", "status", status.status_agreement),
        _entry("main_grad", "differential", main_grad.main_grad_accumulation),
    )
}


def get(name: str) -> Property:
    """The property called ``name``; the error lists the known names."""
    if name not in PROPERTIES:
        raise ValueError(f"unknown property {name!r}; known: {', '.join(PROPERTIES)}")
    return PROPERTIES[name]
