"""Run one case through an adapter: the engine's job (`verify.properties.job`), another callee.

Inputs, upstream gradients and the result dict are the engine's own (same build, layouts, tied
weights, faults), so every property judges an adapter exactly as it judges lce. `adapter_job` is
the worker-side entry for TP > 1 (``"verify.adapters.execute:adapter_job"``).
"""

from __future__ import annotations

from typing import Any

import torch

from verify.adapters.interface import Adapter, Call
from verify.cases.build import IGNORE_INDEX, Problem, build
from verify.cases.spec import CaseSpec
from verify.properties import job

ADAPTER_JOB = "verify.adapters.execute:adapter_job"


def adapter_job(payload: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """``payload``: the engine's job payload plus ``"impl"``, the adapter's ref."""
    from verify.adapters.selection import resolve

    return execute_payload(payload, ctx, resolve(payload["impl"]))


def execute_payload(payload: dict[str, Any], ctx: Any, adapter: Adapter) -> dict[str, Any]:
    """`execute` on a job payload (``spec`` JSON, optional planted ``mutant``)."""
    spec = CaseSpec.from_json(payload["spec"])
    if spec.tp != ctx.tp_size:
        raise ValueError(f"spec.tp={spec.tp} but the job runs on a TP group of {ctx.tp_size}")
    mutant = payload.get("mutant")
    if mutant is None:
        return execute(spec, ctx, adapter)
    from verify.running.mutants import (
        applied,
    )  # mutants patch lce: meaningful for the lce adapter only

    with applied(mutant):
        return execute(spec, ctx, adapter)


def execute(spec: CaseSpec, ctx: Any, adapter: Adapter) -> dict[str, Any]:
    """This rank's outputs of ``adapter`` on ``spec``, as `verify.properties.job.execute` returns,
    with the inputs on ``adapter.device``.

    Any exception of third-party code is a refusal (``status="raised"``), judged by the properties.
    """
    problem = job.on_device(build(spec), torch.device(adapter.device))
    try:
        return _run(spec, problem, ctx, adapter)
    except Exception as exc:  # a third-party failure is a verdict, not a crash of the search
        return {"status": "raised", "error_type": type(exc).__name__, "error": str(exc)[:500]}


def _run(spec: CaseSpec, problem: Problem, ctx: Any, adapter: Adapter) -> dict[str, Any]:
    inputs = job._inputs(spec, problem, ctx)
    leaves = [inputs[k] for k in ("hidden", "weight") if inputs[k].requires_grad]
    before = {k: inputs[k].detach().clone() for k in ("hidden", "weight", "targets")}
    shape, twice = spec.target_shape(), spec.grads == "twice"

    def call() -> Call:
        return Call(
            job._head_hidden(spec, problem, inputs), inputs["weight"], inputs["targets"],
            IGNORE_INDEX, inputs["temperature"], ctx.tp_group if spec.tp > 1 else None,
            inputs["vocab_start"], spec.reduce_hidden, spec.backend, spec.chunk_size,
        )  # fmt: skip

    result: dict[str, Any] = {"status": "ok"}
    with torch.enable_grad() if leaves else torch.no_grad():
        if adapter.token_outputs is not None:
            out = adapter.token_outputs(call())
            result["logprobs"] = out["logprobs"]
            pairs = [(out["logprobs"], job.upstream_view(problem.grad_logprob, spec, shape))]
            if "entropy" in adapter.outputs:
                result["entropy"] = out["entropy"]
                if problem.grad_entropy is not None:
                    grad = job.upstream_view(problem.grad_entropy, spec, shape)
                    pairs.append((out["entropy"], grad))
            result.update(job._grads(pairs, inputs, leaves, "grad_", twice))
        if adapter.loss is not None:
            loss = adapter.loss(call(), spec.reduction)
            result["loss"] = loss
            grad = problem.grad_loss
            if spec.reduction == "none":
                grad = job.upstream_view(grad, spec, shape)
            result.update(job._grads([(loss, grad)], inputs, leaves, "loss_grad_", twice))
    result["inputs_unchanged"] = all(
        torch.equal(before[k], inputs[k].detach()) and before[k].dtype == inputs[k].dtype
        for k in before
    )
    if adapter.contract.outputs == "input":
        # Exact upcast: the rounding to the input dtype is still measured; only the dtype differs.
        for name in ("logprobs", "entropy", "loss"):
            if name in result and result[name].dtype != torch.float64:
                result[name] = result[name].float()
    result["dtypes"] = {k: str(v.dtype) for k, v in result.items() if isinstance(v, torch.Tensor)}
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in result.items()}
