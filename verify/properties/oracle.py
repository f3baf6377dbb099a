"""The oracle of a spec: the float64 reference R, the stock baseline B and every error bound derived
from the case, computed in one place, once per spec.

`oracle(spec)` builds the spec's global problem, runs R and B on it (flattened like
`verify.execution.outcome.assemble` flattens what the ranks gave, so every property compares like
with like) and derives the bounds lazily: a property reads ``oracle -> compare -> verdict``.
`compute_ahead(spec)` starts that in a background thread while the spec's kernel runs on a worker
(R's bits are the same in any thread).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property

import torch

from lce.options import LogitOptions
from verify.adapters.builtin import MAIN_GRAD_ASSUMED_LOSS_GRAD, main_grad_old_content
from verify.cases.build import TIE_SCALE, Problem, build
from verify.cases.layouts import operand_layouts, with_layout
from verify.cases.memo import sized_memo
from verify.cases.rank_inputs import effective_temperature, vocab_range
from verify.cases.spec import CaseSpec
from verify.execution import stage_timing
from verify.numerics.compare import half_subnormal
from verify.numerics.dot_orders import summation_orders
from verify.numerics.reference import (
    Reference,
    Upstream,
    baseline,
    logit_map,
    loss_upstream_grad,
    reference,
)

FP32_U = torch.finfo(torch.float32).eps / 2


class Oracle:
    """R and B of every output of a valid spec (float64, flattened like `assemble`'s: ``[N]``,
    ``[N, H]``), the problem they came from, and the spec's derived error bounds (each computed
    on first use, then kept)."""

    def __init__(self, spec: CaseSpec) -> None:
        self.spec = spec
        with stage_timing.stage("build"):
            self.problem: Problem = build(spec)
        self.ref: dict[str, torch.Tensor] = {}
        self.base: dict[str, torch.Tensor] = {}
        problem = self.problem
        runs = (
            ("", Upstream(logprob=problem.grad_logprob, entropy=problem.grad_entropy)),
            ("loss_", Upstream(loss=self.loss_upstream(problem.grad_loss))),
        )
        for fn, out, name in (
            (reference, self.ref, "reference"),
            (baseline, self.base, "baseline"),
        ):
            with stage_timing.stage(name):
                operands = self._operands(fn is baseline)
                for prefix, upstream in runs:
                    run = fn(*operands, upstream=upstream, **self._options())
                    out.update(self._outputs(run, prefix))
                    if not prefix:
                        out["loss"] = run.loss(spec.reduction)
                del out["loss_logprobs"], out["loss_entropy"]

    @property
    def valid(self) -> torch.Tensor:
        """bool ``[N]``: the target is not ignored."""
        return self.problem.valid

    def loss_upstream(self, grad_loss: torch.Tensor) -> torch.Tensor:
        """The upstream gradient on the per-token losses of the spec's loss under ``grad_loss``
        (float64: dividing an fp32 upstream by the valid count in fp32 would round it, 1/3)."""
        return loss_upstream_grad(self.valid, self.spec.reduction, grad_loss.double())

    @property
    def options(self) -> LogitOptions:
        """The model options the implementation is called with (`lce.LogitOptions`)."""
        return self.spec.logit_options(effective_temperature(self.spec))

    def _options(self) -> dict:
        return {"ignore_index": self.problem.ignore_index, "options": self.options,
                "bias": self.problem.bias}  # fmt: skip

    def _operands(self, stored: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden, the global weight and targets; ``stored``: hidden in weight's dtype and both
        stored as the implementation gets them (B multiplies that storage)."""
        hidden, weight = self.problem.hidden, self.problem.weight
        if stored:
            layouts = operand_layouts(self.spec)
            hidden = with_layout(hidden.detach().to(weight.dtype), layouts[0])
            weight = with_layout(weight.detach(), layouts[1])
        return hidden, weight, self.problem.targets

    def _outputs(self, run: Reference, prefix: str) -> dict[str, torch.Tensor]:
        grad_hidden, grad_weight = run.grad_hidden, run.grad_weight
        if self.tied:
            # One weight used as embedding and LM head: its gradient is the sum of both uses.
            embed = torch.zeros_like(grad_weight).index_add_(0, self.problem.embed_ids, grad_hidden)
            grad_weight = grad_weight + TIE_SCALE * embed
        out = {
            f"{prefix}logprobs": run.logprobs,
            f"{prefix}entropy": run.entropy,
            f"{prefix}grad_hidden": grad_hidden,
            f"{prefix}grad_weight": grad_weight,
        }
        if run.grad_bias is not None:
            out[f"{prefix}grad_bias"] = run.grad_bias
        return out

    @property
    def tied(self) -> bool:
        return tied(self.spec)

    def tied_share(self, per_hidden: torch.Tensor, per_weight: torch.Tensor) -> torch.Tensor:
        """``per_weight`` plus, for a tied weight, ``TIE_SCALE`` times ``per_hidden`` scattered
        onto the embedding rows (a bound on grad_weight gains the embedding use's share, as R
        does)."""
        if not self.tied:
            return per_weight
        embed = torch.zeros_like(per_weight).index_add_(0, self.problem.embed_ids, per_hidden)
        return per_weight + TIE_SCALE * embed

    def magnitudes_under(self, upstream: Upstream) -> dict[str, torch.Tensor]:
        """`Reference.magnitudes` (``grad_hidden``, ``grad_weight``, ``grad_bias`` with a bias)
        under these upstream gradients (empty without any)."""
        return self.terms_under(upstream).magnitudes or {}

    def terms_under(self, upstream: Upstream) -> Reference:
        """R under these upstream gradients, with its magnitudes and d_logits."""
        return reference(
            self.problem.hidden, self.problem.weight, self.problem.targets, upstream=upstream,
            magnitudes=True, slope_error=self.slope_error, **self._options(),
        )  # fmt: skip

    @cached_property
    def terms(self) -> dict[str, Reference]:
        """R's runs with their magnitudes and d_logits, by output prefix: ``""`` under the
        per-token upstreams, ``"loss_"`` under the loss's."""
        problem = self.problem
        return {
            "": self.terms_under(Upstream(problem.grad_logprob, problem.grad_entropy)),
            "loss_": self.terms_under(Upstream(loss=self.loss_upstream(problem.grad_loss))),
        }

    @property
    def slope_error(self) -> float:
        """A softcap's slope ``(1 - r)(1 + r)`` from an fp32 ``r`` (off by ~2 ulp of 1) is off
        by up to 4 fp32 ulps absolutely, in units of the GEMMs' dtype (`math_ratio`): counted
        into every term's size, so a saturated lane (slope ~0 in R) still grants its rounding."""
        if self.options.softcap is None:
            return 0.0
        return 4 * math_ratio(self.problem.weight.dtype)

    @cached_property
    def magnitudes(self) -> dict[str, torch.Tensor]:
        """Per gradient output of R (``grad_hidden``, ``loss_grad_weight``, ...), the float64 sum
        of the absolute values of the terms each element sums (`Reference.magnitudes`): any order
        of summing n of them in unit roundoff u is off by at most about n * u times this."""
        return {
            prefix + name: value
            for prefix, run in self.terms.items()
            for name, value in (run.magnitudes or {}).items()
        }

    def loss_magnitudes(self, grad_loss: float | None = None) -> dict[str, torch.Tensor]:
        """`Reference.magnitudes` of the spec's loss under its own upstream gradient, or under the
        constant ``grad_loss`` when given."""
        upstream = self.problem.grad_loss
        if grad_loss is not None:
            upstream = torch.full_like(upstream, grad_loss)
        return self.magnitudes_under(Upstream(loss=self.loss_upstream(upstream)))

    @cached_property
    def dot_order_error(self) -> torch.Tensor:
        """Per raw dot ``hidden @ weight.T`` of fp32 operands, how far from exact it may land in
        a correct kernel's order (the worst of `summation_orders`), whatever order the ratio
        tier's base summed in. Where every partial sum carries a common offset, an order rounds
        up to n additions at ~|z|, and the base (B, or a peer) may have rounded few there:
        lce's fp32 log-probs were 1.07x the ratio tier on the H200 (Triton's index order, H =
        16, against B), and 1.07x again on another CPU's BLAS (H = 160, offset 10, against
        megatron-core's lucky 1.5e-8): 8 lanes folded in sequence land 3.7e-6 from exact
        there, index order 1.1e-6. Zeros for 16-bit and fp64 weights: there the logits' own
        rounding (16-bit) dwarfs the fp32 accumulator's order, and no fp64 kernel tiles its
        dots (Triton refuses fp64)."""
        hidden, weight = self.problem.hidden, self.problem.weight
        worst = torch.zeros(hidden.shape[0], weight.shape[0], dtype=torch.float64)
        if weight.dtype == torch.float32:
            hidden = hidden.float()
            exact = hidden.double() @ weight.double().T
            for dots in summation_orders(hidden, weight):
                worst = torch.maximum(worst, (dots.double() - exact).abs())
        return worst

    def logit_scales(self, dot_rounding: bool = False) -> dict[str, torch.Tensor]:
        """Per output of R, the scale of its error when every logit carries its dtype's rounding
        (``|dz| <= u |z|``): `verify.numerics.compare`'s ``logit_scale`` (tolerances.yaml's
        ``zeps`` = 2u weighs it); see `logit_scales` for the derivation."""
        return self._logit_scales[dot_rounding]

    @cached_property
    def _logit_scales(self) -> dict[bool, dict[str, torch.Tensor]]:
        return {flag: logit_scales(self, flag) for flag in (False, True)}

    @cached_property
    def subnormal_bounds(self) -> dict[str, torch.Tensor]:
        """Per gradient output, the absolute error its GEMMs' d_logits input may carry when
        rounded to the matmul's dtype (weight's): each element is off by up to ``u |d| + s/2``
        (s the smallest subnormal). The relative part is in `logit_scales`; this is the absolute
        part, which no relative term covers: a mean loss over 44 peaked fp16 rows has d ~ 1e-6,
        below fp16's smallest normal (6e-5), where a rounding errs by up to 3e-8, 3% of d. So
        ``grad_weight[v, h]`` may be off by ``s/2 sum_t |h[t, h]|`` and ``grad_hidden[t, h]`` by
        ``s/2 sum_v |w[v, h]|``, over valid rows (an ignored row's d is exactly 0). Negligible
        (< 1e-40) but for fp16."""
        problem = self.problem
        half_step = half_subnormal(problem.weight.dtype)
        valid = problem.valid[:, None].to(torch.float64)
        hidden = problem.hidden.to(problem.weight.dtype).to(torch.float64)
        weight = problem.weight.to(torch.float64)
        per_hidden = half_step * valid * weight.abs().sum(0)  # [N, H]
        per_weight = (half_step * (valid * hidden.abs()).sum(0)).expand_as(weight)  # [V, H]
        per_weight = self.tied_share(per_hidden, per_weight)
        per_name = {"grad_hidden": per_hidden, "grad_weight": per_weight}
        if problem.bias is not None:  # grad_bias[v] sums one d_logits element per valid row
            per_name["grad_bias"] = (half_step * valid.sum()).expand(problem.bias.shape)
        return {prefix + name: b for prefix in ("", "loss_") for name, b in per_name.items()}

    @cached_property
    def d_logits_rounding(self) -> dict[str, torch.Tensor]:
        """Per gradient output, the elementwise error of rounding d_logits once to the GEMMs'
        dtype (weight's): ``u |d| + s/2`` per term, so ``u`` times `magnitudes` (tied: plus the
        embedding's share) plus `subnormal_bounds`. The logit terms (`logit_scales`) count this
        rounding inside ``max|z|`` times the sums; this is the rounding alone, for checks where
        the logits' own rounding cancels (the same logits in every run) but d_logits' does not."""
        unit = torch.finfo(self.problem.weight.dtype).eps / 2
        sizes, subnormal = dict(self.magnitudes), self.subnormal_bounds
        for prefix in ("", "loss_"):
            if prefix + "grad_weight" in sizes:
                sizes[prefix + "grad_weight"] = self.tied_share(
                    sizes[prefix + "grad_hidden"], sizes[prefix + "grad_weight"]
                )
        return {name: unit * size + subnormal[name] for name, size in sizes.items()}


_BACKGROUND = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lce-oracle")
_ahead: dict[CaseSpec, Future[Oracle]] = {}  # the latest `compute_ahead`, until it is read


def tied(spec: CaseSpec) -> bool:
    """The head's weight is also its embedding (hidden depends on it) in ``spec``'s problem."""
    return spec.tied and spec.transform != "untie"


def oracle(spec: CaseSpec) -> Oracle:
    """The `Oracle` of a valid ``spec`` (cached: many properties check the same spec)."""
    ahead = _ahead.pop(spec, None)
    return ahead.result() if ahead is not None else _oracle(spec)


def compute_ahead(spec: CaseSpec) -> None:
    """Start `oracle` of a valid ``spec`` in the background (one spec at a time: the last)."""
    _ahead.clear()
    _ahead[spec] = _BACKGROUND.submit(_oracle, spec)


@sized_memo(max_items=64)
def _oracle(spec: CaseSpec) -> Oracle:
    return Oracle(spec)


def logit_scales(oracle: Oracle, dot_rounding: bool) -> dict[str, torch.Tensor]:
    """`Oracle.logit_scales`, derived.

    ``dot_rounding``: each logit also carries its dot's summation rounding, ``|dz| <= u |z| +
    n u_acc sum_k |h_k||w_k| / T`` (any order of summing the n = hidden_size products in the
    accumulation dtype, to first order), so ``|z|`` becomes ``|z| + (u_acc / u) n sum|h||w| /
    T``. Where every partial sum of a dot carries a large common offset, each of its additions
    rounds at ~|z| and the dot is off by more than u |z| (1.57 u |z| measured, n = 8).

    Log-probs: ``max|z|`` of the row (``dz_y - sum p dz``). Entropy: ``max|z| * (1 + sum p
    |z - E z|)`` (H = lse - E z is a difference of two numbers of ~``max|z|``, each rounded, and
    the logits' rounding moves H by ``sum p dz (z - E z)``), plus the softmax sum's rounding
    times ``1 + |E z|`` (it moves lse by its share and E z by its share of E z; a wide peaked
    row's entropy was 1.04x the ratio tier without it). The loss: its reduction of the
    log-probs' scales. Gradients: the largest ``max|z|`` (at least 1: each term is rounded once
    more in the gradient's dtype, partials at TP > 1 before their sum; at least the softmax
    sum's rounding, `softmax_sum_rounding`: at V = 65537 with a common offset of 10, B's
    grad_hidden sat at 0.96 of the envelope without it) times the absolute-term
    sums of `Oracle.magnitudes` (``dp = p (dz - E dz)``). The entropy part ``d_z = -g_ent p
    (z - E z)`` adds sums of ``|g_ent| p ((1 - p) + spread) / T``: rounded logits move it by
    ``g_ent p (dz - E dz - sum_k p_k (dz_k - E dz)(z_k - E z))`` (plus dp's share, relative),
    with ``|dz_j - E dz| <= (1 - p_j) 2u max|z|``, however small ``z - E z`` and so
    ``|d_logits|`` is (fp64 at |z| ~ 770: lce 3.8e-14 from exact arithmetic, R and B 4.7e-14 with
    the same rounding, so |K - R| was 7x the ratio tier). ``1 - p`` keeps it from granting a
    confident row's target lane ``u * 1``: a planted ``1 - p_y`` rounded at 1 still fails, 135x
    (tests/verify/test_properties_findings.py; 326x without this term)."""
    spec, problem = oracle.spec, oracle.problem
    z, size, dlogit = _logit_sizes(oracle, dot_rounding)
    zmax, entropy_scale, entropy_sizes = _row_sizes(oracle, z, size, dlogit)
    valid = problem.valid
    logprobs = torch.where(valid, zmax, 0.0)
    per_token = torch.where(valid, _token_loss_scale(oracle, z, zmax), 0.0)
    loss = {"none": per_token, "sum": per_token.sum()}.get(spec.reduction)
    if loss is None:
        loss = per_token.sum() / valid.sum()
    entropy = torch.where(valid, entropy_scale, 0.0)
    out = {"logprobs": logprobs, "entropy": entropy, "loss": loss}
    top = float(logprobs.max()) if logprobs.numel() else 0.0
    top = max(top, 1.0, softmax_sum_rounding(spec.vocab, problem.weight.dtype))
    sizes = oracle.magnitudes
    for name, value in sizes.items():
        if not name.startswith("loss_") and entropy_sizes is not None:
            value = value + entropy_sizes[name]
        out[name] = value
    for prefix in ("", "loss_"):
        if prefix + "grad_weight" in out:
            out[prefix + "grad_weight"] = oracle.tied_share(
                out[prefix + "grad_hidden"], out[prefix + "grad_weight"]
            )
    return {name: value if name in ("logprobs", "entropy", "loss") else top * value
            for name, value in out.items()}  # fmt: skip


def map_rounding_ratio(options: LogitOptions, dtype: torch.dtype) -> float:
    """How many units of ``dtype``'s roundoff one rounding of the logit map's arithmetic costs
    (`math_ratio`); 0 for the plain head, whose ``/ T`` the logits' own term covers."""
    if options.logit_scale == 1.0 and options.softcap is None:
        return 0.0
    return math_ratio(dtype)


def math_ratio(dtype: torch.dtype) -> float:
    """fp32's unit roundoff in units of ``dtype``'s (fp64's for fp64): the logit map and the loss
    terms run in fp32 (fp64 for fp64 weights) whatever dtype the logits were formed in."""
    math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.finfo(math_dtype).eps / torch.finfo(dtype).eps


def _logit_sizes(
    oracle: Oracle, dot_rounding: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits ``z``, what each one's error is made of in units of u (``|dz| <= u size``)
    and ``dz/da`` per lane.

    The raw ``a = h @ W.T + b`` rounds like a logit (``|a|``, and ``|a + b|`` again for a bias
    added after the dot), and the dot's error in a correct kernel's summation order
    (`Oracle.dot_order_error`) enters in units of u (zeps = 2u weighs it, granted twice alike);
    the map carries that by ``dz/da``. Its own fp32 arithmetic adds
    ``2 |z|`` (a scale and ``/ T``) or ``3 |z| + 2 cap / T`` (and the tanh, off by up to ~2 ulp
    of 1 wherever it saturates) in fp32's units (`map_rounding_ratio`)."""
    problem, options = oracle.problem, oracle.options
    hidden = problem.hidden.to(problem.weight.dtype).to(torch.float64)
    weight = problem.weight.to(torch.float64)
    dots = hidden @ weight.T
    raw = dots if problem.bias is None else dots + problem.bias.double()
    raw_size = dots.abs() + oracle.dot_order_error / FP32_U
    if problem.bias is not None:
        raw_size = raw_size + raw.abs()
    if dot_rounding:
        # Dots accumulate in fp32 (fp64 for fp64) whatever dtype the logits are rounded to.
        acc = torch.float64 if problem.weight.dtype == torch.float64 else torch.float32
        ratio = torch.finfo(acc).eps / torch.finfo(problem.weight.dtype).eps
        raw_size = raw_size + ratio * oracle.spec.hidden_size * (hidden.abs() @ weight.abs().T)
    z, gain = logit_map(raw, options)
    dlogit = gain.abs() / options.temperature
    size = raw_size * dlogit
    ratio = map_rounding_ratio(options, problem.weight.dtype)
    if ratio:
        cap_terms = (
            0.0 if options.softcap is None else z.abs() + 2 * options.softcap / options.temperature
        )
        size = size + ratio * (2 * z.abs() + cap_terms)
    return z, size, dlogit


def _token_loss_scale(oracle: Oracle, z: torch.Tensor, zmax: torch.Tensor) -> torch.Tensor:
    """Per token, the loss's error scale: ``max|z|`` for each of ``-log p_y`` and the smoothing
    term's ``lse - mean z``, times ``1 + 2 c |lse|`` with a z-loss (``c lse^2`` moves by ``2 c
    lse dlse``), plus the fp32 rounding of ``c lse^2`` itself."""
    options = oracle.options
    eps, c = options.label_smoothing, options.z_loss
    scale = zmax
    if c > 0 and z.shape[-1]:
        lse = torch.logsumexp(z, dim=-1)
        ratio = math_ratio(oracle.problem.weight.dtype)
        scale = zmax * (1.0 + eps + 2 * c * lse.abs()) + ratio * c * lse * lse
    elif eps:
        scale = zmax * (1.0 + eps)
    return scale


def _row_sizes(
    oracle: Oracle, z: torch.Tensor, size: torch.Tensor, dlogit: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor] | None]:
    """Per row: the largest logit size, the entropy's scale, and the entropy part's
    absolute-term sums of the gradients (None without an entropy upstream); see
    `logit_scales`."""
    problem = oracle.problem
    if z.shape[-1] == 0 or z.shape[0] == 0:
        zmax = z.new_zeros(z.shape[0])
        return zmax, zmax, None
    zmax = size.amax(dim=-1)
    p = torch.softmax(z, dim=-1)
    mean = (p * z).sum(-1, keepdim=True)
    spread = (p * (z - mean).abs()).sum(-1)
    sums = softmax_sum_rounding(z.shape[-1], problem.weight.dtype)
    entropy = zmax * (1.0 + spread) + sums * (1.0 + mean[:, 0].abs())
    if problem.grad_entropy is None:
        return zmax, entropy, None
    g_ent = torch.where(problem.valid, problem.grad_entropy.double(), 0.0)
    share = (1.0 - p).clamp_min(0.0) + spread[:, None]
    sizes = g_ent.abs()[:, None] * p * share * dlogit
    hidden = problem.hidden.to(problem.weight.dtype).to(torch.float64)
    out = {
        "grad_hidden": sizes @ problem.weight.to(torch.float64).abs(),
        "grad_weight": sizes.T @ hidden.abs(),
    }
    if problem.bias is not None:
        out["grad_bias"] = sizes.sum(0)
    return zmax, entropy, out


def softmax_sum_rounding(vocab: int, dtype: torch.dtype) -> float:
    """How far a correct kernel's softmax sum of ``vocab`` terms lands from exact, relatively,
    in units of ``dtype``'s u: ``sqrt(V)`` roundings of its fp32 math (fp64's for fp64: V
    additions at the sum's scale, in any order, as a random walk). It moves every ``p`` by that
    share, as a logit of that size would."""
    return math.sqrt(vocab) * math_ratio(dtype)


def buffer_rounding(exp: Oracle) -> torch.Tensor:
    """Elementwise bound ``gamma_n * (|old| + M_a + M)`` on the rounding main_grad's gain carries.

    main_grad ends as a floating-point sum of its old content and the rows' terms, in whatever
    order the accumulation GEMMs choose (a CPU BLAS adds row by row into the loaded buffer:
    measured 3.8 u |old| with one chunk). Any order of summing them rounds at most once per
    addition, each by ``u`` times a partial sum, so by ``gamma_n = n u / (1 - n u)`` times a
    bound on every partial sum. Additions: one per valid row as lce's forward accumulates the
    gradient for the assumed upstream, two per valid row whose upstream differs (backward takes
    that row out and adds the true one, `lce.grad_buffer`), and the adapter's ``after - old``.
    Partial sums: within ``|old|`` plus the absolute-term sums of the assumed pass (``M_a``) and
    of the true gradient (``M``). ``u`` is main_grad's (fp32; fp64 for fp64 weights). Rows of an
    ignored token add exact zeros; the gradient's own rounding is the tiers' business.
    """
    spec, problem = exp.spec, exp.problem
    shards = [problem.weight[slice(*vocab_range(spec, rank))] for rank in range(spec.tp)]
    old = torch.cat([main_grad_old_content(shard) for shard in shards])
    valid = problem.valid
    assumed = torch.full_like(problem.grad_loss, MAIN_GRAD_ASSUMED_LOSS_GRAD)
    differs = valid & (problem.grad_loss != assumed).expand(valid.shape)
    additions = int(valid.sum()) + 2 * int(differs.sum()) + 1
    unit = torch.finfo(old.dtype).eps / 2
    gamma = additions * unit / (1 - additions * unit)
    true_terms = exp.magnitudes["loss_grad_weight"]
    assumed_terms = true_terms  # the same upstream on every valid row: the same terms
    if differs.any():
        assumed_terms = exp.loss_magnitudes(MAIN_GRAD_ASSUMED_LOSS_GRAD)["grad_weight"]
    return gamma * (old.double().abs() + assumed_terms + true_terms)
