"""The one execution path: run a case on one TP rank through an adapter (lce's own included).

`execute(spec, rank, adapter)` builds the rank's inputs (`verify.cases.rank_inputs`), calls the
implementation, collects gradients of ``sum(output * upstream)``, checks the inputs were left
alone and records the dtypes. `case_job` is what a pool worker runs (``CASE_JOB``); the `Runner`
calls `run_payload` directly in this process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

import torch
import torch.distributed as dist

from verify.adapters.interface import OUTPUTS, Adapter, Call
from verify.adapters.registry import resolve
from verify.cases.build import Problem, build
from verify.cases.rank_inputs import RankInputs, rank_inputs, upstream_view
from verify.cases.spec import CaseSpec
from verify.execution import stage_timing
from verify.execution.dtensor_leaves import dtensor_inputs, local_grads
from verify.execution.mutants import applied

CASE_JOB = "verify.execution.execute:case_job"


class OutsideLimits(RuntimeError):
    """The harness generated a case outside the adapter's declared `Limits` (a harness bug)."""


class Rank(Protocol):
    """Where a case runs: `verify.distributed.JobContext` in a worker, `LocalRank` in-process."""

    tp_rank: int
    tp_size: int
    tp_group: dist.ProcessGroup | None
    device: torch.device


@dataclass(frozen=True)
class LocalRank:
    """The only rank of a TP=1 case run in this process."""

    device: torch.device
    tp_group: dist.ProcessGroup | None = None
    tp_rank: int = 0
    tp_size: int = 1


def case_payload(spec: CaseSpec, impl: str = "lce", mutant: str | None = None) -> dict[str, Any]:
    """What `case_job` takes: the spec's JSON, the adapter's ref, a planted bug or None."""
    return {"spec": spec.to_json(), "impl": impl, "mutant": mutant}


def case_job(payload: dict[str, Any], rank: Rank) -> dict[str, Any]:
    """A worker's entry: ``payload`` from `case_payload`."""
    return run_payload(payload, rank, resolve(payload["impl"]))


def run_payload(payload: dict[str, Any], rank: Rank, adapter: Adapter) -> dict[str, Any]:
    """`execute` on a job payload: ``{"spec": CaseSpec JSON, "mutant": name or None, ...}``.

    The result's ``"timing"`` is the job's `stage_timing` split (build, transfer, kernel, compile).
    """
    spec = CaseSpec.from_json(payload["spec"])
    if spec.tp != rank.tp_size:
        raise ValueError(f"spec.tp={spec.tp} but the job runs on a TP group of {rank.tp_size}")
    mutant = payload.get("mutant")
    stage_timing.watch_triton_compiles()
    with stage_timing.recording() as clock, applied(mutant):
        result = execute(spec, rank, adapter)
    return {**result, "timing": clock.take()}


def execute(spec: CaseSpec, rank: Rank, adapter: Adapter) -> dict[str, Any]:
    """This rank's outputs of ``adapter`` on ``spec`` as CPU tensors keyed by name (per-token
    outputs, loss, ``grad_*`` and ``loss_grad_*``), ``inputs_unchanged``, ``dtypes`` and
    ``compute_s`` (the implementation's calls and their gradients, not the build).

    The problem is built on the CPU (the same numbers everywhere), then moved to ``rank.device``.
    An exception in ``adapter.refusals`` becomes ``status="raised"`` (the status property). A
    spec outside the adapter's declared `Limits` is a harness bug: `OutsideLimits`, no call.
    """
    broken = adapter.capabilities.limits.violations(spec)
    if broken:
        raise OutsideLimits(f"{adapter.name}: spec outside its declared limits: {broken}")
    with stage_timing.stage("build"):
        problem = build(spec)
    with stage_timing.stage("transfer"):
        problem = on_device(problem, torch.device(rank.device))

    def run() -> dict[str, Any]:
        inputs = rank_inputs(spec, problem, rank.tp_rank)
        inputs = dtensor_inputs(spec, inputs, problem, rank.tp_group)
        return _run(spec, inputs, problem, rank, adapter)

    try:
        with stage_timing.stage("kernel"):
            result = as_in_a_fresh_process(run)
        with stage_timing.stage("transfer"):
            return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in result.items()}
    except adapter.refusals as exc:
        if fatal_device_error(exc):
            raise  # the process's device is unusable: a crash, not a refusal of the input
        return {"status": "raised", "error_type": type(exc).__name__, "error": str(exc)[:500]}


def as_in_a_fresh_process(run: Callable[[], Any]) -> Any:
    """``run()``; where it meets Dynamo's recompile limit (an implementation that compiles
    inside, as CCE's ``impl='torch_compile'`` does under ``fullgraph=True``, after the
    worker's earlier examples filled its cache), ``run()`` again with an empty cache: the
    verdict is then the one a fresh process replaying the case gives."""
    try:
        return run()
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        torch._dynamo.reset()
        return run()


# What a device error says when it leaves the process's CUDA context unusable (every later call
# fails): a crash of the implementation, like a signal, never a refusal of its input.
FATAL_DEVICE_ERRORS = ("CUDA error", "device-side assert", "illegal memory access")


def fatal_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a device error after which this process cannot run CUDA work."""
    return type(exc).__name__ == "AcceleratorError" or any(
        text in str(exc) for text in FATAL_DEVICE_ERRORS
    )


def on_device(problem: Problem, device: torch.device) -> Problem:
    """``problem`` with every tensor on ``device`` (values unchanged)."""
    if device.type == "cpu":
        return problem
    moved = {
        f.name: value.to(device) if isinstance(value, torch.Tensor) else value
        for f in fields(problem)
        for value in [getattr(problem, f.name)]
    }
    return replace(problem, **moved)


def _run(
    spec: CaseSpec, inputs: RankInputs, problem: Problem, rank: Rank, adapter: Adapter
) -> dict[str, Any]:
    leaves = inputs.leaves
    before = inputs.snapshot()
    shape, twice = spec.target_shape(), spec.grads == "twice"
    plain = spec.dtensor == "none"  # a DTensor's mesh gives the TP group and vocab_start

    def call() -> Call:
        return Call(
            inputs.head_hidden(), inputs.weight, inputs.targets, ignore_index=inputs.ignore_index,
            options=inputs.options, tp_group=rank.tp_group if spec.tp > 1 and plain else None,
            vocab_start=inputs.vocab_start if plain else None,
            reduce_grad_hidden=spec.reduce_hidden,
            backend=spec.backend, chunk_size=spec.chunk_size, loss_path=spec.loss_path,
            bias=inputs.bias,
        )  # fmt: skip

    result: dict[str, Any] = {"status": "ok"}
    began = time.perf_counter()
    with torch.enable_grad() if leaves else torch.no_grad():
        if adapter.token_outputs is not None:
            out = adapter.token_outputs(call())
            result["logprobs"] = out["logprobs"]
            pairs = [(out["logprobs"], upstream_view(problem.grad_logprob, spec, shape))]
            if "entropy" in adapter.outputs:
                result["entropy"] = out["entropy"]
                if problem.grad_entropy is not None:
                    grad = upstream_view(problem.grad_entropy, spec, shape)
                    pairs.append((out["entropy"], grad))
            result.update(_grads(pairs, inputs, "grad_", twice, spec, rank.tp_rank))
        if adapter.loss is not None:
            loss = adapter.loss(call(), spec.reduction)
            result["loss"] = loss
            grad = problem.grad_loss
            if spec.reduction == "none":
                grad = upstream_view(grad, spec, shape)
            result.update(_grads([(loss, grad)], inputs, "loss_grad_", twice, spec, rank.tp_rank))
    if torch.device(rank.device).type == "cuda":
        torch.cuda.synchronize(rank.device)
    result["compute_s"] = time.perf_counter() - began
    result["inputs_unchanged"] = inputs.unchanged_since(before)
    # The dtypes as returned: an input-dtype output's rounding is granted by its dtype
    # (`verify.properties.verdict.returned_rounding`).
    result["dtypes"] = {k: str(v.dtype) for k, v in result.items() if isinstance(v, torch.Tensor)}
    if adapter.contract.outputs == "input":
        # Exact upcast: the rounding to the input dtype is still measured; only the dtype differs.
        for name in OUTPUTS:  # the outputs whose dtype the contract sets
            if name in result and result[name].dtype != torch.float64:
                result[name] = result[name].float()
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in result.items()}


def _grads(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    inputs: RankInputs,
    prefix: str,
    twice: bool,
    spec: CaseSpec,
    tp_rank: int,
) -> dict[str, Any]:
    """Gradients of ``sum(output * upstream)`` w.r.t. the leaves that require grad, as this
    rank's local tensors (`local_grads`; ``prefix + "grad_layouts"`` names a DTensor leaf's
    gradient not laid out as its leaf); ``twice``: backward with ``retain_graph`` and again,
    returning the second and whether both agree."""
    leaves = {name: t for name, t in inputs.named_leaves().items() if t.requires_grad}
    if not leaves:
        return {}
    outputs, upstreams = zip(*pairs, strict=True)
    order = list(leaves.values())
    runs = [torch.autograd.grad(outputs, order, upstreams, allow_unused=True, retain_graph=twice)]
    if twice:
        runs.append(torch.autograd.grad(outputs, order, upstreams, allow_unused=True))
    local = [local_grads(spec, tp_rank, dict(zip(leaves, g, strict=True)), leaves) for g in runs]
    grads, wrong = local[-1]
    named: dict[str, Any] = {prefix + name: grad for name, grad in grads.items()}
    if wrong:
        named[prefix + "grad_layouts"] = wrong
    if twice:
        named[prefix + "twice_equal"] = all(
            torch.equal(a, b) for a, b in zip(local[0][0].values(), grads.values(), strict=True)
        )
    return named
