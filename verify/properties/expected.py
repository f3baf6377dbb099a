"""What a case should give: the float64 reference R and the stock baseline B of a spec.

`expected(spec)` materializes R and B on the spec's global problem, flattened like
`verify.execution.outcome.assemble` flattens what the ranks gave, so every property compares like
with like. `compute_ahead(spec)` starts that in a background thread while the spec's kernel runs
on a GPU worker (the two then overlap; R's bits are the same in any thread).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import torch

from verify.cases.build import TIE_SCALE, Problem, build
from verify.cases.rank_inputs import effective_temperature, operand_layouts, with_layout
from verify.cases.spec import CaseSpec
from verify.numerics.compare import half_subnormal
from verify.numerics.reference import (
    Reference,
    baseline,
    loss_upstream_grad,
    reference,
)
from verify.running import stage_timing


@dataclass(frozen=True)
class Expected:
    """float64 R and B values of every output, flattened like `assemble`'s (``[N]``, ``[N, H]``)."""

    ref: dict[str, torch.Tensor]
    base: dict[str, torch.Tensor]
    problem: Problem


_BACKGROUND = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lce-expected")
_ahead: dict[CaseSpec, Future[Expected]] = {}  # the latest `compute_ahead`, until it is read


def expected(spec: CaseSpec) -> Expected:
    """R and B of a valid ``spec`` (cached: many properties check the same spec)."""
    ahead = _ahead.pop(spec, None)
    return ahead.result() if ahead is not None else _expected(spec)


def compute_ahead(spec: CaseSpec) -> None:
    """Start `expected` of a valid ``spec`` in the background (one spec at a time: the last)."""
    _ahead.clear()
    _ahead[spec] = _BACKGROUND.submit(_expected, spec)


@lru_cache(maxsize=64)
def _expected(spec: CaseSpec) -> Expected:
    with stage_timing.stage("build"):
        problem = build(spec)
    loss_upstream = _loss_upstream(spec, problem)
    ref: dict[str, torch.Tensor] = {}
    base: dict[str, torch.Tensor] = {}
    for fn, out, name in ((reference, ref, "reference"), (baseline, base, "baseline")):
        args = (problem.hidden, problem.weight, problem.targets)
        kw = {"ignore_index": problem.ignore_index, "temperature": effective_temperature(spec)}
        if fn is baseline:
            kw["layouts"] = operand_layouts(spec)
        with stage_timing.stage(name):
            tokens = fn(
                *args, grad_logprob=problem.grad_logprob, grad_entropy=problem.grad_entropy, **kw
            )
            loss_run = fn(*args, grad_logprob=loss_upstream, **kw)
            out.update(_outputs(spec, problem, tokens, ""))
            out["loss"] = tokens.loss(spec.reduction)
            out.update(_outputs(spec, problem, loss_run, "loss_"))
            del out["loss_logprobs"], out["loss_entropy"]
    return Expected(ref, base, problem)


@lru_cache(maxsize=16)
def gradient_magnitudes(spec: CaseSpec) -> dict[str, torch.Tensor]:
    """Per gradient output of R (``grad_hidden``, ``loss_grad_weight``, ...), the float64 sum of
    the absolute values of the terms each element sums (`Reference.magnitudes`): any order of
    summing n of them in unit roundoff u is off by at most about n * u times this."""
    problem = build(spec)
    runs = {
        "": _magnitudes(spec, problem, problem.grad_logprob, problem.grad_entropy),
        "loss_": loss_magnitudes(spec),
    }
    out = {}
    for prefix, run in runs.items():
        if run is not None:
            out[prefix + "grad_hidden"], out[prefix + "grad_weight"] = run
    return out


@lru_cache(maxsize=16)
def loss_magnitudes(
    spec: CaseSpec, grad_loss: float | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`Reference.magnitudes` (grad_hidden, grad_weight) of the spec's loss under its own upstream
    gradient, or under the constant ``grad_loss`` when given (None without gradients)."""
    problem = build(spec)
    upstream = problem.grad_loss
    if grad_loss is not None:
        upstream = torch.full_like(upstream, grad_loss)
    grad_logprob = loss_upstream_grad(problem.valid, spec.reduction, upstream.double())
    return _magnitudes(spec, problem, grad_logprob, None)


def _magnitudes(
    spec: CaseSpec,
    problem: Problem,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    return reference(
        problem.hidden, problem.weight, problem.targets, ignore_index=problem.ignore_index,
        temperature=effective_temperature(spec), grad_logprob=grad_logprob,
        grad_entropy=grad_entropy, magnitudes=True,
    ).magnitudes  # fmt: skip


FP32_U = torch.finfo(torch.float32).eps / 2


def index_order_dots(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``hidden @ weight.T`` summed k = 0..n-1 with one rounding per step, as a fused
    multiply-add rounds (fp32 products are exact in fp64): a tiled GPU kernel's order."""
    dots = torch.zeros(hidden.shape[0], weight.shape[0], dtype=torch.float32)
    for k in range(hidden.shape[1]):
        dots = (dots.double() + hidden[:, k, None].double() * weight[:, k].double()).float()
    return dots


@lru_cache(maxsize=64)
def dot_order_excess(spec: CaseSpec) -> torch.Tensor:
    """Per raw dot ``hidden @ weight.T`` of fp32 operands, how much further from exact it lands
    in `index_order_dots`' order (the H200's Triton forward matched it to 3 digits) than in B's
    (the CPU BLAS's on the operands' storage, `operand_layouts`). Where every partial sum carries
    a common offset, index order rounds each of n additions at ~|z| and a BLAS's blocked sums
    round few of them there: lce's fp32 log-probs were 1.07x the ratio tier on the H200 (H = 16,
    1.25e-5 against B's 2.1e-6; this order's model 1.26e-5). Zeros for 16-bit and fp64 weights:
    there the logits' own rounding (16-bit) dwarfs the fp32 accumulator's order, and no fp64
    kernel tiles its dots (Triton refuses fp64)."""
    problem = build(spec)
    if problem.weight.dtype != torch.float32:
        return torch.zeros(problem.hidden.shape[0], problem.weight.shape[0], dtype=torch.float64)
    hidden, weight = problem.hidden.to(torch.float32), problem.weight
    layouts = operand_layouts(spec)
    exact = hidden.double() @ weight.double().T
    blas = with_layout(hidden, layouts[0]) @ with_layout(weight, layouts[1]).T
    excess = (index_order_dots(hidden, weight).double() - exact).abs() - (
        blas.double() - exact
    ).abs()
    return excess.clamp_min(0.0)


@lru_cache(maxsize=64)
def logit_scales(spec: CaseSpec, dot_rounding: bool = False) -> dict[str, torch.Tensor]:
    """Per output of R, the scale of its error when every logit carries its dtype's rounding
    (``|dz| <= u |z|``): `verify.numerics.compare`'s ``logit_scale`` (tolerances.yaml's ``zeps``
    = 2u weighs it).

    ``dot_rounding``: each logit also carries its dot's summation rounding, ``|dz| <= u |z| +
    n u_acc sum_k |h_k||w_k| / T`` (any order of summing the n = hidden_size products in the
    accumulation dtype, to first order), so ``|z|`` becomes ``|z| + (u_acc / u) n sum|h||w| /
    T``. Where every partial sum of a dot carries a large common offset, each of its additions
    rounds at ~|z| and the dot is off by more than u |z| (1.57 u |z| measured, n = 8).

    Log-probs: ``max|z|`` of the row (``dz_y - sum p dz``). Entropy: ``max|z| * (1 + sum p
    |z - E z|)`` (H = lse - E z is a difference of two numbers of ~``max|z|``, each rounded, and
    the logits' rounding moves H by ``sum p dz (z - E z)``). The loss: its reduction of the
    log-probs' scales. Gradients: the largest ``max|z|`` (at least 1: each term is rounded once
    more in the gradient's dtype, partials at TP > 1 before their sum) times the absolute-term
    sums of `gradient_magnitudes` (``dp = p (dz - E dz)``). The entropy part ``d_z = -g_ent p
    (z - E z)`` adds sums of ``|g_ent| p ((1 - p) + spread) / T``: rounded logits move it by
    ``g_ent p (dz - E dz - sum_k p_k (dz_k - E dz)(z_k - E z))`` (plus dp's share, relative),
    with ``|dz_j - E dz| <= (1 - p_j) 2u max|z|``, however small ``z - E z`` and so
    ``|d_logits|`` is (fp64 at |z| ~ 770: lce 3.8e-14 from exact arithmetic, R and B 4.7e-14 with
    the same rounding, so |K - R| was 7x the ratio tier). ``1 - p`` keeps it from granting a
    confident row's target lane ``u * 1``: a planted ``1 - p_y`` rounded at 1 still fails, 135x
    (tests/test_properties_findings.py; 326x without this term)."""
    problem = build(spec)
    hidden = problem.hidden.to(problem.weight.dtype).to(torch.float64)
    weight = problem.weight.to(torch.float64)
    temperature = effective_temperature(spec)
    z = hidden @ weight.T / temperature
    # zeps = 2u weighs |z|: another order's excess enters in units of u, granted twice alike
    size = z.abs() + dot_order_excess(spec) / temperature / FP32_U
    if dot_rounding:
        # Dots accumulate in fp32 (fp64 for fp64) whatever dtype the logits are rounded to.
        acc = torch.float64 if problem.weight.dtype == torch.float64 else torch.float32
        ratio = torch.finfo(acc).eps / torch.finfo(problem.weight.dtype).eps
        terms = hidden.abs() @ weight.abs().T / temperature
        size = size + ratio * spec.hidden_size * terms
    entropy_sizes = None
    if z.shape[-1] == 0 or z.shape[0] == 0:
        zmax = z.new_zeros(z.shape[0])
        spread = zmax
    else:
        zmax = size.amax(dim=-1)
        p = torch.softmax(z, dim=-1)
        spread = (p * (z - (p * z).sum(-1, keepdim=True)).abs()).sum(-1)
        if problem.grad_entropy is not None:
            g_ent = torch.where(problem.valid, problem.grad_entropy.double(), 0.0)
            share = (1.0 - p).clamp_min(0.0) + spread[:, None]
            sizes = (g_ent.abs() / temperature)[:, None] * p * share
            entropy_sizes = (sizes @ weight.abs(), sizes.T @ hidden.abs())
    valid = problem.valid
    logprobs = torch.where(valid, zmax, 0.0)
    loss = {"none": logprobs, "sum": logprobs.sum()}.get(spec.reduction)
    if loss is None:
        loss = logprobs.sum() / valid.sum()
    entropy = torch.where(valid, zmax * (1.0 + spread), 0.0)
    out = {"logprobs": logprobs, "entropy": entropy, "loss": loss}
    top = max(float(logprobs.max()) if logprobs.numel() else 0.0, 1.0)
    sizes = gradient_magnitudes(spec)
    for prefix in ("", "loss_"):
        if prefix + "grad_hidden" not in sizes:
            continue
        hidden_size, weight_size = sizes[prefix + "grad_hidden"], sizes[prefix + "grad_weight"]
        if prefix == "" and entropy_sizes is not None:
            hidden_size = hidden_size + entropy_sizes[0]
            weight_size = weight_size + entropy_sizes[1]
        weight_size = _tied_share(spec, problem, hidden_size, weight_size)
        out[prefix + "grad_hidden"] = top * hidden_size
        out[prefix + "grad_weight"] = top * weight_size
    return out


@lru_cache(maxsize=64)
def gradient_subnormal_bounds(spec: CaseSpec) -> dict[str, torch.Tensor]:
    """Per gradient output, the absolute error its GEMMs' d_logits input may carry when rounded
    to the matmul's dtype (weight's): each element is off by up to ``u |d| + s/2`` (s the smallest
    subnormal). The relative part is in `logit_scales`; this is the absolute part, which no
    relative term covers: a mean loss over 44 peaked fp16 rows has d ~ 1e-6, below fp16's
    smallest normal (6e-5), where a rounding errs by up to 3e-8, 3% of d. So ``grad_weight[v, h]``
    may be off by ``s/2 sum_t |h[t, h]|`` and ``grad_hidden[t, h]`` by ``s/2 sum_v |w[v, h]|``,
    over valid rows (an ignored row's d is exactly 0). Negligible (< 1e-40) but for fp16."""
    problem = build(spec)
    half_step = half_subnormal(problem.weight.dtype)
    valid = problem.valid[:, None].to(torch.float64)
    hidden = problem.hidden.to(problem.weight.dtype).to(torch.float64)
    weight = problem.weight.to(torch.float64)
    per_hidden = half_step * valid * weight.abs().sum(0)  # [N, H]
    per_weight = (half_step * (valid * hidden.abs()).sum(0)).expand_as(weight)  # [V, H]
    per_weight = _tied_share(spec, problem, per_hidden, per_weight)
    bounds = {}
    for prefix in ("", "loss_"):
        bounds[prefix + "grad_hidden"], bounds[prefix + "grad_weight"] = per_hidden, per_weight
    return bounds


@lru_cache(maxsize=64)
def d_logits_rounding_bounds(spec: CaseSpec) -> dict[str, torch.Tensor]:
    """Per gradient output, the elementwise error of rounding d_logits once to the GEMMs' dtype
    (weight's): ``u |d| + s/2`` per term, so ``u`` times `gradient_magnitudes` (tied: plus the
    embedding's share) plus `gradient_subnormal_bounds`. The logit terms (`logit_scales`) count
    this rounding inside ``max|z|`` times the sums; this is the rounding alone, for checks where
    the logits' own rounding cancels (the same logits in every run) but d_logits' does not."""
    problem = build(spec)
    unit = torch.finfo(problem.weight.dtype).eps / 2
    sizes, subnormal = gradient_magnitudes(spec), gradient_subnormal_bounds(spec)
    bounds = {}
    for prefix in ("", "loss_"):
        if prefix + "grad_hidden" not in sizes:
            continue
        hidden_size, weight_size = sizes[prefix + "grad_hidden"], sizes[prefix + "grad_weight"]
        weight_size = _tied_share(spec, problem, hidden_size, weight_size)
        for name, size in (("grad_hidden", hidden_size), ("grad_weight", weight_size)):
            bounds[prefix + name] = unit * size + subnormal[prefix + name]
    return bounds


def _tied_share(
    spec: CaseSpec, problem: Problem, per_hidden: torch.Tensor, per_weight: torch.Tensor
) -> torch.Tensor:
    """``per_weight`` plus, for a tied weight, ``TIE_SCALE`` times ``per_hidden`` scattered onto
    the embedding rows (a bound on grad_weight gains the embedding use's share, as R does)."""
    if not spec.tied or spec.transform == "untie":
        return per_weight
    embed = torch.zeros_like(per_weight).index_add_(0, problem.embed_ids, per_hidden)
    return per_weight + TIE_SCALE * embed


def _loss_upstream(spec: CaseSpec, problem: Problem) -> torch.Tensor:
    """The upstream gradient on logprobs of the spec's loss."""
    valid = problem.valid
    # float64: dividing the fp32 upstream by the valid count in fp32 would round it (1/3).
    return loss_upstream_grad(valid, spec.reduction, problem.grad_loss.double())


def _outputs(spec: CaseSpec, problem: Problem, run: Reference, prefix: str) -> dict:
    grad_hidden, grad_weight = run.grad_hidden, run.grad_weight
    if spec.tied and spec.transform != "untie":
        # One weight used as embedding and LM head: its gradient is the sum of both uses.
        embed = torch.zeros_like(grad_weight).index_add_(0, problem.embed_ids, grad_hidden)
        grad_weight = grad_weight + TIE_SCALE * embed
    return {
        f"{prefix}logprobs": run.logprobs,
        f"{prefix}entropy": run.entropy,
        f"{prefix}grad_hidden": grad_hidden,
        f"{prefix}grad_weight": grad_weight,
    }
