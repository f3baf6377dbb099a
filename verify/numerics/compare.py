"""The three-tier comparison of one output against the reference R and the baseline B.

Tier 1 (ratio) and tier 2 (envelope) as in tolerances.yaml; a `Verdict` records what was measured,
what was allowed and which tier decided, so a report shows how close to the line each output sits.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from verify.numerics.tolerances import Tolerance


@dataclass(frozen=True)
class Verdict:
    """One output's comparison. ``ratio`` = worst measured/allowed over the tiers (<= 1 passes)."""

    output: str
    passed: bool
    tier: str  # the tier with the worst ratio: "ratio", "envelope" or "nonfinite"
    measured: float
    allowed: float
    ratio: float
    detail: str

    def to_json(self) -> dict:
        return asdict(self)


def _nonfinite_mismatch(kernel: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool((torch.isnan(kernel) != torch.isnan(ref)).any()) or bool(
        (torch.isinf(kernel) != torch.isinf(ref)).any()
    )


def compare(
    output: str,
    kernel: torch.Tensor,
    ref: torch.Tensor,
    base: torch.Tensor | None,
    tol: Tolerance,
    runs: int = 1,
) -> Verdict:
    """Check ``kernel`` against ``ref`` (float64) under ``tol``; ``base`` is B's value or None.

    ``runs`` = 2 when ``ref`` is itself a rounded result (two kernel runs that must agree): each
    run may be off by its own bound, so the floor and the envelope count twice and ``base - ref``
    should carry the sum of the two runs' baseline errors."""
    k = kernel.detach().to(torch.float64).reshape(-1)
    r = ref.detach().to(torch.float64).reshape(-1)
    if k.shape != r.shape:
        raise ValueError(f"{output}: kernel shape {tuple(k.shape)} != reference {tuple(r.shape)}")
    if _nonfinite_mismatch(k, r):
        return Verdict(
            output, False, "nonfinite", math.inf, 0.0, math.inf, "NaN/inf pattern differs"
        )
    finite = torch.isfinite(r)
    k, r = k[finite], r[finite]
    if r.numel() == 0:
        return Verdict(output, True, "ratio", 0.0, 0.0, 0.0, "no finite elements")
    err = (k - r).abs()
    scale = r.abs().max().item()
    checks: list[tuple[str, float, float]] = []
    if base is not None:
        b = base.detach().to(torch.float64).reshape(-1)[finite]
        base_err = (b - r).abs()
        floor = runs * tol.floor * scale
        checks.append(("ratio", err.max().item(), tol.alpha * base_err.max().item() + floor))
        checks.append(("ratio", err.mean().item(), tol.alpha * base_err.mean().item() + floor))
    norm_allowed = runs * (
        tol.atol * math.sqrt(r.numel()) + tol.rtol * torch.linalg.vector_norm(r).item()
    )
    checks.append(("envelope", torch.linalg.vector_norm(k - r).item(), norm_allowed))
    worst = max(checks, key=lambda c: _ratio(c[1], c[2]))
    ratios = [_ratio(m, a) for _, m, a in checks]
    detail = ", ".join(f"{t}: {m:.3g} <= {a:.3g}" for t, m, a in checks)
    return Verdict(output, max(ratios) <= 1.0, worst[0], worst[1], worst[2], max(ratios), detail)


def _ratio(measured: float, allowed: float) -> float:
    if measured == 0.0:
        return 0.0
    return math.inf if allowed == 0.0 else measured / allowed
