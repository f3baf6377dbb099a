"""The main_grad property: lce's 3-GEMM loss into a caller's buffer leaves the buffer at exactly
its old content plus the gradient (Megatron's gradient_accumulation_fusion contract)."""

from __future__ import annotations

from verify.cases.spec import CaseSpec
from verify.execution.runner import Runner
from verify.properties.oracle import oracle
from verify.properties.verdict import PropertyVerdict, flag, tolerance_check, tolerance_for

OUTPUTS = ("loss", "loss_grad_hidden", "loss_grad_weight", "loss_grad_bias")


def main_grad_accumulation(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """main_grad gains the loss's weight gradient on top of its old content (tiers 1-2 vs R).

    The case runs with ``loss_path="main_grad"``: main_grad starts with random old content at the
    weight's scale and the adapter reports what it gained (`verify.adapters.builtin`), so a path
    that overwrites, drops or double-counts the old content, or adds a wrong gradient, fails here
    (with the loss and grad_hidden of the same call). What it gained also carries the buffer's
    own rounding (`verify.properties.oracle.buffer_rounding`), which `tolerance_check` grants
    the weight gradient of every main_grad case, whichever property judges it.
    Cases that cannot take the path (two backwards, no weight gradient) run as drawn.
    """
    on_path = spec.grads in ("both", "weight")
    if on_path:
        spec = spec.with_(loss_path="main_grad")
    run = runner.run(spec)
    if run.status != "ok":
        return [flag("main_grad", spec, "status", False, f"refused a valid case: {run.error}")]
    exp = oracle(spec)
    return [
        tolerance_check(
            "main_grad",
            spec,
            name,
            run.outputs[name],
            exp.ref[name],
            exp.base[name],
            tolerance_for(spec, name),
            statistical=True,
        )
        for name in OUTPUTS
        if name in run.outputs
    ]
