"""Metamorphic properties: two runs of related cases whose outputs must agree (listed in
docs/DESIGN.md).

Each check takes ``(spec, runner)`` and returns verdicts; a check that does not apply to a spec
returns none. Agreement between two low-precision runs is held to the sum of the two runs'
tolerances vs R (`pair_check`); relations that hold exactly in floating point use the exact tier.
"""

from __future__ import annotations

import math

import torch

from verify.cases.build import TIE_SCALE, build, draw
from verify.cases.spec import DTYPES, LINEARITY_A, CaseSpec
from verify.execution.outcome import TOLERANCE_OUTPUT, VOCAB_SHARDED, KernelRun
from verify.execution.runner import Runner
from verify.numerics.compare import half_subnormal
from verify.numerics.tolerances import load
from verify.properties.oracle import buffer_rounding, oracle, softmax_sum_rounding
from verify.properties.verdict import (
    PropertyVerdict,
    bound_check,
    exact_check,
    flag,
    pair_check,
    refused,
    tolerance_check,
    tolerance_for,
)

GRADS = tuple(name for name in TOLERANCE_OUTPUT if "grad_" in name)


def _runs(prop: str, spec: CaseSpec, runner: Runner, other: CaseSpec):
    """Both runs, or a failing verdict when either was refused."""
    a, b = runner.run(spec), runner.run(other)
    for run, s in ((a, spec), (b, other)):
        if run.status != "ok":
            return None, [refused(prop, s, run.error)]
    return (a, b), []


def _agree(
    prop: str,
    spec: CaseSpec,
    a: KernelRun,
    b: KernelRun,
    names=None,
    transform=None,
    other: CaseSpec | None = None,
) -> list[PropertyVerdict]:
    """``a`` (on ``spec``) vs ``b`` (on ``other``, its outputs mapped back by ``transform``) under
    the dtype's tolerance for two runs (`pair_check`), scaled by the baseline's errors on both
    problems; ``other=None``: b ran the same problem (R and B do not depend on the TP degree or
    the chunk size), so its baseline error is a's. fp64 cases use the exact invariance bound,
    with the output's fp64 ``atol`` per element as its floor (entropy near 0 is a difference of
    O(1) terms: a summation order change moves it by an ulp of 1, not of itself)."""
    transform = transform or (lambda name, value: value)
    exp = oracle(spec)
    exp_other = exp if other is None else oracle(other)
    tols = load()
    out = []
    for name in names or a.outputs:
        if name not in a.outputs or name not in b.outputs:
            continue
        b_value = transform(name, b.outputs[name])
        tol = tolerance_for(spec, name)
        if spec.dtype_key == "fp64":
            rel = tols.exact["invariance_fp64"]
            out.append(exact_check(prop, spec, name, a.outputs[name], b_value, rel, tol.atol))
            continue
        base_error = (exp.base[name] - exp.ref[name]).abs() + transform(
            name, exp_other.base[name] - exp_other.ref[name]
        ).abs()
        args = (prop, spec, name, a.outputs[name], b_value, base_error, tol)
        out.append(pair_check(*args, returned=a.dtypes.get(name)))
    return out


def tp_invariance(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """TP = k agrees with TP = 1 as closely as TP = 1 agrees with R."""
    runs, bad = _runs("tp_invariance", spec, runner, spec.with_(tp=1))
    return bad or _agree("tp_invariance", spec, *runs)


def chunk_invariance(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """Torch backend: chunk size 1 agrees with the spec's chunk size."""
    other = spec.with_(chunk_size=1 if spec.chunk_size != 1 else None)
    runs, bad = _runs("chunk_invariance", spec, runner, other)
    return bad or _agree("chunk_invariance", spec, *runs)


def vocab_permutation(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """Permuting weight rows (and bias entries) and remapping targets permutes grad_weight (and
    grad_bias) and changes nothing else."""
    other = spec.with_(transform="vocab_permute")
    runs, bad = _runs("vocab_permutation", spec, runner, other)
    if bad:
        return bad
    permutation = draw(spec).permutation

    def unpermute(name: str, value: torch.Tensor) -> torch.Tensor:
        if name not in VOCAB_SHARDED:
            return value
        back = torch.empty_like(value)
        back[permutation] = value  # row i of the permuted run is row permutation[i] originally
        return back

    return _agree("vocab_permutation", spec, *runs, transform=unpermute, other=other)


def shift_invariance(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """Outputs under a common logit offset match R of the same case without the offset.

    grad_hidden's column 0 (the constant feature carrying the offset) is ``offset * sum_j dz_j``:
    zero in exact math, offset-times-rounding in any float implementation, so it is left out.
    The logit term counts each dot's summation rounding (`logit_scales`' ``dot_rounding``): the
    offset enters every partial sum of a logit's dot, so each addition rounds at ~|z| (the
    Triton interpreter's dots: 1.57 u |z| at H = 8, past the one rounding u |z| models; without
    column 0 no large element lifts the ratio tier's max above it, as in `differential`).
    """
    run = runner.run(spec)
    if run.status != "ok":
        return [refused("shift_invariance", spec, run.error)]
    ref, base = oracle(spec.with_(transform="unshift")).ref, oracle(spec).base
    out = []
    for name, value in run.outputs.items():
        columns = slice(1, None) if name.endswith("grad_hidden") else None
        tol = tolerance_for(spec, name)
        args = ("shift_invariance", spec, name, value, ref[name], base[name], tol)
        returned = run.dtypes.get(name)
        out.append(tolerance_check(*args, columns=columns, dot_rounding=True, returned=returned))
    return out


def entropy_target_independence(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """Entropy does not depend on the targets: other targets (same ignore mask), same entropy."""
    runs, bad = _runs("entropy_targets", spec, runner, spec.with_(transform="retarget"))
    if bad:
        return bad
    a, b = runs
    rel = load().exact["invariance_fp64"]
    return [
        exact_check(
            "entropy_targets", spec, "entropy", a.outputs["entropy"], b.outputs["entropy"], rel
        )
    ]


def upstream_linearity(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """``bwd(A * g1 + g2) = A * bwd(g1) + bwd(g2)`` for every gradient (A = LINEARITY_A), judged
    by `linearity_check`."""
    specs = [spec.with_(transform=t) for t in LINEARITY_RUNS]
    runs = [runner.run(s) for s in specs]
    for run, s in zip(runs, specs, strict=True):
        if run.status != "ok":
            return [refused("upstream_linearity", s, run.error)]
    return [
        linearity_check(spec, name, *(run.outputs[name] for run in runs))
        for name in GRADS
        if name in runs[0].outputs
    ]


# The three runs of `upstream_linearity`: upstream a, upstream b, LINEARITY_A * a + b.
LINEARITY_RUNS = ("upstream_a", "upstream_b", "upstream_mix")


def linearity_check(
    spec: CaseSpec, name: str, a: torch.Tensor, b: torch.Tensor, mixed: torch.Tensor
) -> PropertyVerdict:
    """``||mixed - (A a + b)||`` (gradient ``name`` of the three `LINEARITY_RUNS`) against the sum
    of what each run may err by, the first scaled by |A|:
    - its envelope's ``atol * sqrt(n) + rtol * ||run||``;
    - the rounding of its d_logits to the GEMMs' dtype, ``u |d| + s/2`` per term
      (`verify.properties.oracle.Oracle.d_logits_rounding`), summed elementwise over the runs.
      The three runs share their logits, so the logits' rounding (the envelope's zeps term)
      moves each run's d_logits linearly in its upstream and cancels; d_logits' own rounding
      differs per run and does not. Without it a float64 model that rounds only d_logits (once,
      to the GEMM's dtype) and the gradients failed as lce did, bit for bit: bf16 grad_weight
      1.01x (|d| ~ 0.1, u = 2^-8), fp16 mean peaked V=2 loss_grad_weight 1.20x (d ~ 1e-6,
      below fp16's smallest normal, where a rounding errs by up to 3e-8 absolutely); the GPU
      nightly's failures of 2026-11-24 (tests/verify/test_properties_findings.py)."""
    tol = tolerance_for(spec, name)
    a, b, mixed = (value.detach().double() for value in (a, b, mixed))
    norms = [abs(LINEARITY_A) * a.norm(), b.norm(), mixed.norm()]
    enveloped = 3 * tol.atol * math.sqrt(a.numel()) + tol.rtol * float(sum(norms))
    steps = 0.0
    if spec.fault == "none":  # as `tolerance_check`: derived terms for clean inputs only
        runs = [oracle(spec.with_(transform=t)) for t in LINEARITY_RUNS]
        rounding = [run.d_logits_rounding[name] for run in runs]
        if name == "loss_grad_weight" and spec.loss_path == "main_grad":
            # each run's gain also carries main_grad's own rounding (`buffer_rounding`)
            rounding = [r + buffer_rounding(run) for r, run in zip(rounding, runs, strict=True)]
        steps = float((abs(LINEARITY_A) * rounding[0] + rounding[1] + rounding[2]).norm())
    measured = float((mixed - (LINEARITY_A * a + b)).norm())
    detail = f"{measured:.3g} <= {enveloped:.3g} (envelopes) + {steps:.3g} (roundings)"
    allowed = enveloped + steps
    return bound_check("upstream_linearity", spec, name, measured, allowed, "envelope", detail)


def ignored_rows_irrelevant(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """Replacing the hidden rows of ignored tokens changes no output and no gradient (exact);
    for an implementation that does not claim bit-identical reruns (`Runner.bitwise_reruns`), to the
    dtype's tolerance for two runs."""
    perturbed = spec.with_(transform="perturb_ignored")
    runs, bad = _runs("ignored_rows", spec, runner, perturbed)
    if bad:
        return bad
    a, b = runs
    if not runner.bitwise_reruns:
        return _agree("ignored_rows", spec, a, b, other=perturbed)
    rel = load().exact["invariance_fp64"]
    return [
        exact_check("ignored_rows", spec, name, a.outputs[name], b.outputs[name], rel)
        for name in a.outputs
    ]


def tied_untied(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """A tied weight's gradient = head gradient + TIE_SCALE * embedding-scattered grad_hidden.

    Allowed, the sum of two derived terms (normwise):
    - 8 ulps of weight's dtype relative to ``||head|| + TIE_SCALE * ||embed||`` (the parts, not
      their sum, which can cancel): autograd rounds each use's gradient to weight's dtype (the
      embedding backward casts grad_hidden) before adding them; the expectation adds the two
      unrounded parts in float64.
    - the summation: the tied and the untied run sum the same terms in other orders (an fp64
      result is no more exact than its sums). A sum of n terms is off by at most n u sum|terms|
      (u: the accumulation's unit roundoff, fp32 below fp64), and either run may be: head
      elements sum T terms (``|d_logits|^T |h|``), grad_hidden elements V terms (``|d_logits|
      |W|``) and index_add up to T rows more. A fixed multiple of ||result|| failed clean fp64
      cases whose sums cancel (T=6, V=17, all logits <= -100: measured 4x over).
    - the absolute part of each rounding: below the smallest normal a rounding errs by up to half
      the smallest subnormal whatever the value (fp16: 3e-8), which no relative term grants. Per
      element, the tied run rounds its head part, each of the r embedding rows scattered into it,
      r - 1 index_add sums and the final sum; the untied run its head part and the r grad_hidden
      rows: 3r + 2 roundings, r the most tokens sharing one embedding id (a GPU nightly failed
      clean fp16 peaked V=2 rows, r = 4, by one subnormal step: 5.2e-8 vs 3.7e-9 allowed).
    """
    runs, bad = _runs("tied_untied", spec, runner, spec.with_(transform="untie"))
    if bad:
        return bad
    tied, untied = runs
    ids = build(spec).embed_ids
    sizes = oracle(spec).magnitudes
    out = []
    eps = torch.finfo(DTYPES[spec.weight_dtype]).eps
    unit = 2.0**-53 if spec.weight_dtype == "fp64" else 2.0**-24
    rows = int(torch.bincount(ids).max()) if ids.numel() else 0
    step = (3 * rows + 2) * half_subnormal(DTYPES[spec.weight_dtype])
    tokens, vocab = spec.num_tokens, spec.vocab
    for prefix in ("grad_", "loss_grad_"):
        if prefix + "weight" not in tied.outputs:
            continue  # an implementation without per-token outputs (or without a loss)
        head = untied.outputs[prefix + "weight"].double()
        scatter = torch.zeros_like(head).index_add_
        embed = scatter(0, ids, untied.outputs[prefix + "hidden"].double())
        expected_sum = head + TIE_SCALE * embed
        measured = float((tied.outputs[prefix + "weight"].double() - expected_sum).norm())
        rounded = 8 * eps * float(head.norm() + TIE_SCALE * embed.norm())
        head_terms = sizes[prefix + "weight"].norm()
        embed_terms = scatter(0, ids, sizes[prefix + "hidden"]).norm()
        summed = 2 * unit * (tokens * head_terms + TIE_SCALE * (vocab + tokens) * embed_terms)
        allowed = rounded + float(summed) + step * math.sqrt(head.numel())
        out.append(bound_check("tied_untied", spec, prefix + "weight", measured, allowed, "exact"))
    return out


def subnormal_d_logits(spec: CaseSpec) -> bool:
    """Some nonzero d_logits of R (either upstream) lies below twice weight's dtype's smallest
    normal: an implementation's rounded d there sits on the subnormal grid, where scaling by a
    power of two is not exact (``e * 2K`` and ``2 (e * K)`` round to different steps)."""
    terms = oracle(spec).terms.values()
    tiny = 2 * torch.finfo(DTYPES[spec.weight_dtype]).tiny
    small = [(d != 0) & (d.abs() < tiny) for d in (t.d_logits for t in terms) if d is not None]
    return any(bool(flags.any()) for flags in small)


def temperature_equivariance(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """Temperature T (a power of two) equals hidden / T at temperature 1, bit for bit up to the
    exact ``grad_hidden * T`` scaling (power-of-two scalings are exact in floating point), but
    where d_logits may be subnormal (`subnormal_d_logits`) or reruns may differ
    (`Runner.bitwise_reruns`): there the dtype's tolerance for two runs. Seeded campaign of
    2026-11-25 (fp32, logits spread over > 90, z-loss 0.01, two-token chunks): d of 5e-41
    scaled after rounding moved loss_grad_weight by an ulp in 7 places."""
    folded = spec.with_(transform="fold_temperature")
    runs, bad = _runs("temperature", spec, runner, folded)
    if bad:
        return bad
    a, b = runs

    def rescale(name: str, value: torch.Tensor) -> torch.Tensor:
        return value / spec.temperature if name.endswith("grad_hidden") else value

    if spec.dtype_key == "fp16" or subnormal_d_logits(spec) or not runner.bitwise_reruns:
        # fp16 d_logits hit subnormals nearly always
        return _agree("temperature", spec, a, b, transform=rescale, other=folded)
    rel = load().exact["invariance_fp64"]
    return [
        exact_check("temperature", spec, name, a.outputs[name], rescale(name, b.outputs[name]), rel)
        for name in a.outputs
    ]


def reduction_consistency(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """The loss equals the reduction of ``-logprobs`` (mean over non-ignored rows).

    Allowed: ``(N + 1) * 2^-24`` relative: an fp32 sum of N same-signed terms and one division;
    plus, absolutely, each token's loss formed twice in fp32: where the log-probs come from
    another call (a peer's ``reduction="none"`` is another kernel: Liger, CCE), ``lse - z`` is
    rounded in each, ``u32`` per unit of the loss's logit scale (max|z|) and of the softmax
    sum's rounding in ``lse`` (`softmax_sum_rounding`), twice. A 3-GEMM loss path (``loss_path``
    other than default) may form its loss from logits materialized in the weight's dtype, as
    the stock path does (lce's Triton backend does; the log-probs come from fp32 dots): then
    each token's loss and log-prob differ by up to the logits' own rounding, ``zeps`` times the
    loss's logit scale (tolerances.yaml), instead. The H100 nightly of 2026-11-25 met it on
    Triton's main_grad path in bf16 (0.0073 of the loss's norm); a reduction bug (a mean over
    every row) still misses by the ignored rows' share.
    """
    run = runner.run(spec)
    if run.status != "ok":
        return []
    logprobs = run.outputs["logprobs"].double()
    case = oracle(spec)
    want = {"none": -logprobs, "sum": -logprobs.sum()}.get(spec.reduction)
    if want is None:
        want = -logprobs.sum() / case.valid.sum()
    rel = 0.0 if spec.reduction == "none" else (spec.num_tokens + 1) * 2.0**-24
    scale = case.logit_scales(dot_rounding=True)["loss"].reshape(-1)
    if spec.loss_path != "default":
        grant = load().get(spec.dtype_key, "loss").zeps * scale
    else:
        valid = case.valid.to(torch.float64)
        rows = {"none": valid, "sum": valid.sum()}.get(spec.reduction, (valid.sum() > 0) * 1.0)
        lse = softmax_sum_rounding(spec.vocab, torch.float32) * rows.reshape(-1)
        grant = 2 * 2.0**-24 * (scale + lse)
    atol = torch.linalg.vector_norm(grant).item() / math.sqrt(max(grant.numel(), 1))
    return [exact_check("reduction", spec, "loss", run.outputs["loss"], want, rel, atol)]


def determinism(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """Two runs of one spec give bit-identical outputs (both backends claim determinism)."""
    a, b = runner.run(spec), runner.run(spec, fresh=True)
    if a.status != b.status:
        return [flag("determinism", spec, "status", False, f"{a.status} then {b.status}")]
    return [
        exact_check("determinism", spec, name, a.outputs[name], b.outputs[name], 0.0)
        for name in a.outputs
    ]
