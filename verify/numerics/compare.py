"""The three-tier comparison of one output against the reference R and the baseline B.

Tier 1 (ratio) and tier 2 (envelope) as in tolerances.yaml; a `Verdict` keeps every tier's
measured and allowed value and names the one closest to (or furthest over) its line, so a report
shows how close each output sits and a caller reads a tier instead of measuring it again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verify.numerics.tolerances import Tolerance


def ratio(measured: float, allowed: float) -> float:
    """``measured / allowed``: 0 when nothing was measured, inf when nothing was allowed or the
    measurement is NaN. <= 1 passes."""
    if measured != measured:  # NaN
        return math.inf
    if measured == 0.0:
        return 0.0
    return math.inf if allowed == 0.0 else measured / allowed


@dataclass(frozen=True)
class Tier:
    """One check: ``name`` is ``ratio`` (tier 1; a max and a mean check), ``envelope`` (tier 2),
    ``nonfinite`` (NaN/inf pattern) or ``exact``."""

    name: str
    measured: float
    allowed: float

    @property
    def ratio(self) -> float:
        return ratio(self.measured, self.allowed)

    @property
    def passed(self) -> bool:
        return self.ratio <= 1.0


@dataclass(frozen=True)
class Verdict:
    """One output's comparison: every tier checked, and the worst of them (``ratio`` <= 1 passes
    for all)."""

    output: str
    tiers: tuple[Tier, ...]
    detail: str

    @property
    def worst(self) -> Tier:
        return max(self.tiers, key=lambda t: t.ratio)

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tiers)

    @property
    def tier(self) -> str:
        return self.worst.name

    @property
    def measured(self) -> float:
        return self.worst.measured

    @property
    def allowed(self) -> float:
        return self.worst.allowed

    @property
    def ratio(self) -> float:
        return self.worst.ratio

    def to_json(self) -> dict:
        """The worst tier's numbers, flat (``output``, ``passed``, ``tier``, ``measured``,
        ``allowed``, ``ratio``, ``detail``)."""
        names = ("output", "passed", "tier", "measured", "allowed", "ratio", "detail")
        return {name: getattr(self, name) for name in names}

    def ratio_of(self, name: str) -> float:
        """The worst ratio among the checks of tier ``name`` (0 when it was not checked)."""
        return max((t.ratio for t in self.tiers if t.name == name), default=0.0)


def half_subnormal(dtype: torch.dtype) -> float:
    """Half the smallest positive subnormal of ``dtype``: the absolute part of one rounding."""
    if not dtype.is_floating_point:
        return 0.0
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps / 2


def nonfinite_mismatch(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` differ in where they hold NaN or where they hold inf."""
    return bool((torch.isnan(a) != torch.isnan(b)).any()) or bool(
        (torch.isinf(a) != torch.isinf(b)).any()
    )


def compare(
    output: str,
    kernel: torch.Tensor,
    ref: torch.Tensor,
    base: torch.Tensor | None,
    tol: Tolerance,
    runs: int = 1,
    logit_scale: torch.Tensor | None = None,
    extra: torch.Tensor | None = None,
    roundings: int = 1,
) -> Verdict:
    """Check ``kernel`` against ``ref`` (float64) under ``tol``; ``base`` is B's value or None
    (then tier 1 is not checked).

    ``logit_scale`` (same shape as ``ref``): what each element's error is made of when the logits
    carry their dtype's rounding (``|dz| <= u |z|``), e.g. ``max|z|`` of a token's row for its
    log-prob. ``tol.zeps`` times it joins both tiers: a correct implementation rounds its logits
    like that whatever B's luck (tier 1) and however small R is (tier 2).

    ``extra`` (same shape as ``ref``): an elementwise error bound the caller derived for what its
    check adds beyond the output's own rounding (e.g. the main_grad property's fp32 buffer); it
    joins both tiers as the logit term does.

    ``runs`` = 2 when ``ref`` is itself a rounded result (two kernel runs that must agree): each
    run may be off by its own bound, so the floor and the envelope count twice and ``base - ref``
    should carry the sum of the two runs' baseline errors.

    ``roundings``: how many results in ``kernel``'s dtype are summed into one element (1; at TP
    > 1 a partial grad_hidden per rank plus the rounding of their sum). Each rounding is off by
    up to u|x| (in the floor and ``logit_scale``) plus half the dtype's smallest subnormal, which
    no relative term covers: an fp16 gradient near 1e-4 has an absolute spacing of 6e-8, so four
    partials rounded there each lose up to 3e-8 whatever the magnitude of the whole."""
    k = kernel.detach().to(torch.float64).reshape(-1)
    r = ref.detach().to(torch.float64).reshape(-1)
    if k.shape != r.shape:
        raise ValueError(f"{output}: kernel shape {tuple(k.shape)} != reference {tuple(r.shape)}")
    if nonfinite_mismatch(k, r):
        return Verdict(output, (Tier("nonfinite", math.inf, 0.0),), "NaN/inf pattern differs")
    finite = torch.isfinite(r)
    k, r = k[finite], r[finite]
    if r.numel() == 0:
        return Verdict(output, (Tier("ratio", 0.0, 0.0),), "no finite elements")
    err = (k - r).abs()
    scale = r.abs().max().item()
    z = torch.zeros_like(r)
    if logit_scale is not None:
        z = tol.zeps * logit_scale.detach().to(torch.float64).reshape(-1)[finite]
    if extra is not None:
        z = z + extra.detach().to(torch.float64).reshape(-1)[finite]
    tiers: list[Tier] = []
    if base is not None:
        b = base.detach().to(torch.float64).reshape(-1)[finite]
        base_err = (b - r).abs()
        floor = runs * (tol.floor * scale + roundings * half_subnormal(kernel.dtype))
        max_allowed = tol.alpha * base_err.max().item() + floor + runs * z.max().item()
        mean_allowed = tol.alpha * base_err.mean().item() + floor + runs * z.mean().item()
        tiers.append(Tier("ratio", err.max().item(), max_allowed))
        tiers.append(Tier("ratio", err.mean().item(), mean_allowed))
    norm_allowed = runs * (
        tol.atol * math.sqrt(r.numel())
        + tol.rtol * torch.linalg.vector_norm(r).item()
        + torch.linalg.vector_norm(z).item()
    )
    tiers.append(Tier("envelope", torch.linalg.vector_norm(k - r).item(), norm_allowed))
    detail = ", ".join(f"{t.name}: {t.measured:.3g} <= {t.allowed:.3g}" for t in tiers)
    return Verdict(output, tuple(tiers), detail)
