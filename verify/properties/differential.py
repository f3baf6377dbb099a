"""Differential property: every output and gradient vs the float64 reference R, with the baseline B
computed on the same inputs in the same run, plus the contract's exact clauses (dtypes, ignored rows
exactly zero, inputs untouched, TP ranks agreeing)."""

from __future__ import annotations

import torch

from verify.cases.spec import DTYPES, CaseSpec
from verify.execution.outcome import KernelRun
from verify.execution.runner import Runner
from verify.numerics.tolerances import load
from verify.properties.oracle import oracle
from verify.properties.verdict import (
    PropertyVerdict,
    exact_check,
    flag,
    refused,
    tolerance_check,
    tolerance_for,
)

PER_TOKEN = ("logprobs", "entropy", "loss", "grad_hidden", "loss_grad_hidden")


def differential(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """Tiers 1-2 of tolerances.yaml for each output the run produced, and the statistical tier
    for its 16-bit gradients."""
    run = runner.run(spec)
    if run.status != "ok":
        return [refused("differential", spec, run.error)]
    exp = oracle(spec)
    return [
        tolerance_check(
            "differential",
            spec,
            name,
            value,
            exp.ref[name],
            exp.base[name],
            tolerance_for(spec, name),
            statistical=True,
            returned=run.dtypes.get(name),
        )
        for name, value in run.outputs.items()
    ]


def contract(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """Exact clauses: output dtypes, ignored rows exactly 0, inputs untouched, ranks agree."""
    run = runner.run(spec)
    if run.status != "ok":
        return [refused("contract", spec, run.error)]
    verdicts = [_dtypes(spec, run, runner.adapter.contract.outputs == "input")]
    verdicts.append(flag("contract", spec, "inputs", run.inputs_unchanged, "inputs unmodified"))
    if spec.tp > 1:
        verdicts.append(flag("contract", spec, "tp_ranks", run.ranks_agree, "ranks bit-equal"))
    if spec.grads == "twice" and runner.bitwise_reruns:
        same = "second backward (retain_graph) bit-equal to the first"
        verdicts.append(flag("contract", spec, "second_backward", run.twice_equal, same))
    ignored = ~oracle(spec).valid
    if bool(ignored.any()):
        rel = load().exact["ignored"]
        for name, value in run.outputs.items():
            if name in PER_TOKEN and value.dim() >= 1:
                rows = value[ignored]
                verdicts.append(
                    exact_check(
                        "contract", spec, f"{name}[ignored]", rows, torch.zeros_like(rows), rel
                    )
                )
    return verdicts


def _dtypes(spec: CaseSpec, run: KernelRun, input_outputs: bool) -> PropertyVerdict:
    """The dtypes the run returned: fp32 log-probs, entropy and loss (for fp64 inputs the torch
    backend keeps fp64, Triton gives fp32: either), or, with ``input_outputs`` (a contract of
    input-dtype outputs), the weight's dtype too; each gradient in its leaf's dtype."""
    hidden, weight = str(DTYPES[spec.hidden_dtype]), str(DTYPES[spec.weight_dtype])
    out = ("torch.float64", "torch.float32") if spec.dtype_key == "fp64" else ("torch.float32",)
    if input_outputs:
        out += (weight,)
    wanted = {"logprobs": out, "entropy": out, "loss": out}
    for prefix in ("grad_", "loss_grad_"):
        wanted[prefix + "hidden"] = (hidden,)
        wanted[prefix + "weight"] = (weight,)
    wrong = {k: v for k, v in run.dtypes.items() if k in wanted and v not in wanted[k]}
    return flag("contract", spec, "dtypes", not wrong, f"wrong dtypes {wrong}" if wrong else "ok")
