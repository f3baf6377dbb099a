"""The comparison of one output against the reference R and the baseline B, tier by tier.

Tier 1 (ratio) and tier 2 (envelope) bound each element as in tolerances.yaml; the statistical
tier (`statistical_tier`) judges the whole output's rounding noise against one rounding's; a
`Verdict` keeps every tier's measured and allowed value and names the one closest to (or furthest
over) its line, so a report shows how close each output sits and a caller reads a tier instead of
measuring it again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verify.numerics.tolerances import Statistical, Tolerance


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
    ``statistical`` (the rounding noise), ``nonfinite`` (NaN/inf pattern) or ``exact``."""

    name: str
    measured: float
    allowed: float
    note: str = ""  # how the tier measured (the statistical tier's degrees of freedom, B's)

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
    rounding: RoundingModel | None = None,
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
    partials rounded there each lose up to 3e-8 whatever the magnitude of the whole.

    ``rounding``: the statistical tier's model of the output (`statistical_tier`); without it,
    or for an output not in a 16-bit dtype, that tier is not checked."""
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
    if rounding is not None and kernel.dtype in NOISE_DTYPES:
        shape = (-1, rounding.span.shape[0])
        other = None if base is None else base.detach().to(torch.float64).reshape(shape)
        noise = statistical_tier(
            kernel.detach().to(torch.float64).reshape(shape), ref.detach().to(torch.float64)
            .reshape(shape), other, kernel.dtype, rounding,
        )  # fmt: skip
        tiers += [noise] if noise is not None else []
    detail = ", ".join(f"{t.name}: {t.measured:.3g} <= {t.allowed:.3g}{t.note}" for t in tiers)
    return Verdict(output, tuple(tiers), detail)


# Outputs whose rounding the statistical tier judges: in fp32 and fp64 the accumulation's own
# roundings are as large as the output's, so one more is no signal (tiers 1-2 bound them closely).
NOISE_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RoundingModel:
    """What the statistical tier knows of a 2-D output ``[N, H]`` besides K, R and B (built per
    case by `verify.properties.rounding_model`).

    ``span`` ``[H, r]``: columns spanning every row's error from *before* the output's GEMM
    (each grad_weight row is a combination of hidden's rows, each grad_hidden row of weight's,
    whatever d_logits the implementation computed: any error of its logits, softmax or
    d_logits lands inside). ``accumulation`` ``[N, H]``: a bound on each element's summation
    error in the accumulation dtype, which lands outside. ``extra_variance`` ``[N, H]`` or None:
    the variance of roundings the case adds besides the output's own (partial grad_hidden per
    rank rounded before their sum). ``tolerance``: the tier's numbers (tolerances.yaml)."""

    span: torch.Tensor
    accumulation: torch.Tensor
    extra_variance: torch.Tensor | None
    tolerance: Statistical


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each |x| (its subnormal spacing below the smallest normal)."""
    info = torch.finfo(dtype)
    binade = torch.floor(torch.log2(x.abs().clamp_min(info.smallest_normal)))
    return torch.exp2(binade) * info.eps


def statistical_tier(
    kernel: torch.Tensor,
    ref: torch.Tensor,
    base: torch.Tensor | None,
    dtype: torch.dtype,
    model: RoundingModel,
) -> Tier | None:
    """The rounding noise of ``kernel`` (float64 ``[N, H]``, returned in ``dtype``) against one
    rounding's; None when too few error components lie outside the span (below
    ``min_dof``: the tier could not tell one rounding from two there).

    Each element's error ``K - R`` is scaled by ``sigma``, one round-to-nearest's standard
    deviation at its magnitude (``ulp / sqrt(12)``, a uniform residue; plus ``extra_variance``),
    and each row's scaled error is projected off the span of what errors before the GEMM can
    produce: what is left is the output's own rounding (and the accumulation's, bounded),
    whatever the logits' precision. One rounding leaves ``d`` (the degrees of freedom) in
    expectation; a second of the same size doubles it. Measured: ``rho = |P e|^2 / d``.
    Allowed: the one-rounding bound that holds but with probability ``exp(-x)``, ``(1 + 2
    sqrt(x F) / d + 2 x / d)`` (a Gaussian quadratic form's tail, which bounds the uniform
    residues' too: they are strictly sub-Gaussian), the accumulation's bound added through the
    triangle inequality, times ``1 + margin`` for residues that are not uniform (a pre-rounding
    value two bits longer than the output leaves 1.125x the variance), and times B's own
    ``rho`` where B's exceeds 1 (a case whose single rounding the model underrates, B shows it
    too). tolerances.yaml (``statistical``) derives each number."""
    tol = model.tolerance
    if model.span.shape[1] >= kernel.shape[1]:
        return None  # the span is every direction of a row: no component lies outside it
    sizes = [kernel.abs(), ref.abs()] + ([base.abs()] if base is not None else [])
    variance = ulp(torch.stack(sizes).amax(0), dtype).pow(2) / 12
    exact = torch.stack(sizes).amax(0) == 0  # zeros everywhere: nothing was rounded
    variance = torch.where(exact, 0.0, variance)
    if model.extra_variance is not None:
        variance = variance + model.extra_variance
    sigma = variance.sqrt()
    safe = torch.where(sigma > 0, sigma, 1.0)
    share = (model.accumulation / safe).pow(2)
    kept = (sigma > 0) & (share <= tol.accumulation_share) & torch.isfinite(ref)
    rows = kept.any(1)
    mask = kept[rows].to(torch.float64)
    basis = span_basis(model.span, safe[rows], mask)
    inside = basis * mask[:, :, None]
    # With P = I - Q Q^T the projector off the span and M the mask, in r x r products (never H x
    # H): trace(M P) = sum M - |M Q|^2 (the degrees of freedom), |M P M|_F^2 = sum M - 2 |M Q|^2
    # + |Q^T M Q|_F^2 (the spread of the quadratic form).
    in_span = inside.pow(2).sum().item()
    dof = mask.sum().item() - in_span
    if dof < tol.min_dof:
        return None
    gram = inside.transpose(1, 2) @ inside
    spread = mask.sum().item() - 2 * in_span + gram.pow(2).sum().item()
    x = tol.false_alarm_exponent
    bound = dof + 2 * math.sqrt(x * spread) + 2 * x
    accumulation = (share[rows] * mask).sum().item()
    allowed = (1 + tol.model_margin) * (math.sqrt(bound) + math.sqrt(accumulation)) ** 2 / dof

    def rho(value: torch.Tensor) -> float:
        scaled = torch.nan_to_num((value - ref)[rows] / safe[rows]) * mask
        off_span = scaled - (basis @ (basis.transpose(1, 2) @ scaled[:, :, None]))[..., 0]
        return off_span.pow(2).sum().item() / dof

    measured = rho(kernel)
    base_rho = rho(base) if base is not None else 0.0
    note = f" (rounding noise, {dof:.0f} dof; B {base_rho:.3g})"
    return Tier("statistical", measured, allowed * max(1.0, base_rho), note)


def span_basis(span: torch.Tensor, sigma: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row ``[rows, H, r]``: orthonormal columns Q spanning the span in that row's scaled
    coordinates (``span / sigma``, masked elements dropped); ``I - Q Q^T`` projects off it. A
    QR's columns span at least the columns it factors, rank-deficient or not: nothing inside the
    span is left out."""
    rows, width = sigma.shape
    if span.shape[1] == 0 or rows == 0:
        return torch.zeros(rows, width, 0, dtype=torch.float64)
    generators = span[None] / sigma[:, :, None] * mask[:, :, None]
    q, _ = torch.linalg.qr(generators)
    return q


def row_span(rows: torch.Tensor) -> torch.Tensor:
    """``[H, r]`` orthonormal columns spanning the rows of ``rows`` ``[m, H]`` (float64): their
    right singular vectors above a relative 1e-12, i.e. every direction the rows reach."""
    width = rows.shape[1]
    if rows.numel() == 0 or not bool(rows.abs().max() > 0):
        return torch.zeros(width, 0, dtype=torch.float64)
    _, singular, right = torch.linalg.svd(rows, full_matrices=False)
    rank = int((singular > SPAN_RELATIVE * singular.max()).sum())
    return right[:rank].T.contiguous()


# Singular values of the span's generators below this fraction of the largest count as zero: the
# generators are exact (float64 of 16-bit or fp32 values), so only rounding in the SVD is below.
SPAN_RELATIVE = 1e-12
