"""The main_grad property: lce's 3-GEMM loss into a caller's buffer leaves the buffer at exactly
its old content plus the gradient (Megatron's gradient_accumulation_fusion contract)."""

from __future__ import annotations

import torch

from verify.adapters.builtin import MAIN_GRAD_ASSUMED_LOSS_GRAD, main_grad_old_content
from verify.cases.rank_inputs import vocab_range
from verify.cases.spec import CaseSpec
from verify.execution.outcome import TOLERANCE_OUTPUT
from verify.execution.runner import Runner
from verify.numerics.tolerances import load
from verify.properties.oracle import Oracle, oracle
from verify.properties.verdict import PropertyVerdict, flag, tolerance_check

OUTPUTS = ("loss", "loss_grad_hidden", "loss_grad_weight", "loss_grad_bias")


def main_grad_accumulation(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """main_grad gains the loss's weight gradient on top of its old content (tiers 1-2 vs R).

    The case runs with ``loss_path="main_grad"``: main_grad starts with random old content at the
    weight's scale and the adapter reports what it gained (`verify.adapters.builtin`), so a path
    that overwrites, drops or double-counts the old content, or adds a wrong gradient, fails here
    (with the loss and grad_hidden of the same call). What it gained also carries the buffer's
    own rounding (`buffer_rounding`), which the weight gradient's tiers are granted on top.
    Cases that cannot take the path (two backwards, no weight gradient) run as drawn.
    """
    on_path = spec.grads in ("both", "weight")
    if on_path:
        spec = spec.with_(loss_path="main_grad")
    run = runner.run(spec)
    if run.status != "ok":
        return [flag("main_grad", spec, "status", False, f"refused a valid case: {run.error}")]
    exp, tols = oracle(spec), load()
    extra = {"loss_grad_weight": buffer_rounding(exp)} if on_path else {}
    return [
        tolerance_check(
            "main_grad",
            spec,
            name,
            run.outputs[name],
            exp.ref[name],
            exp.base[name],
            tols.get(spec.dtype_key, TOLERANCE_OUTPUT[name]),
            extra=extra.get(name),
        )
        for name in OUTPUTS
        if name in run.outputs
    ]


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
