"""The worker-side job: build this rank's inputs from a spec, run lce forward and backward.

`run_case(payload, ctx)` is what the distributed pool calls on every rank (``"verify.properties.
job:run_case"``); `run_local(spec)` calls the same code in-process at TP=1. Outputs come back as CPU
tensors keyed by name; an exception of lce becomes ``status="raised"`` (the status property).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist

import lce
from verify.cases.build import (
    IGNORE_INDEX,
    Problem,
    build,
    effective_temperature,
    explicit_vocab_start,
    tied_hidden,
    vocab_range,
)
from verify.cases.spec import CaseSpec

JOB = "verify.properties.job:run_case"
# Exceptions that count as "lce refused the input" (status agreement); anything else propagates.
REFUSALS = (ValueError, TypeError, IndexError, RuntimeError)


@dataclass(frozen=True)
class LocalContext:
    """The part of the pool's JobContext the job reads, for in-process TP=1 runs."""

    tp_group: dist.ProcessGroup | None = None
    tp_rank: int = 0
    tp_size: int = 1


def run_case(payload: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """``payload``: ``{"spec": CaseSpec JSON, "mutant": name or None}``; ``ctx``: a JobContext."""
    spec = CaseSpec.from_json(payload["spec"])
    if spec.tp != ctx.tp_size:
        raise ValueError(f"spec.tp={spec.tp} but the job runs on a TP group of {ctx.tp_size}")
    mutant = payload.get("mutant")
    if mutant is None:
        return execute(spec, ctx)
    from verify.running.mutants import applied  # only self-tests plant bugs

    with applied(mutant):
        return execute(spec, ctx)


def run_local(spec: CaseSpec, mutant: str | None = None) -> dict[str, Any]:
    """`run_case` in this process; only for ``spec.tp == 1``."""
    return run_case({"spec": spec.to_json(), "mutant": mutant}, LocalContext())


def execute(spec: CaseSpec, ctx: Any) -> dict[str, Any]:
    """This rank's outputs: per-token outputs, loss, gradients, input-integrity and dtypes.

    The problem is built on the CPU (the same numbers everywhere), then moved to ``ctx.device``.
    """
    problem = on_device(build(spec), getattr(ctx, "device", torch.device("cpu")))
    try:
        return _run(spec, problem, ctx)
    except REFUSALS as exc:
        return {"status": "raised", "error_type": type(exc).__name__, "error": str(exc)[:500]}


def on_device(problem: Problem, device: torch.device) -> Problem:
    """``problem`` with every tensor on ``device`` (values unchanged)."""
    if torch.device(device).type == "cpu":
        return problem
    moved = {
        f.name: value.to(device) if isinstance(value, torch.Tensor) else value
        for f in fields(problem)
        for value in [getattr(problem, f.name)]
    }
    return replace(problem, **moved)


def with_layout(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as ``tensor`` stored ``contiguous``, ``transposed`` (last two dims) or
    ``sliced`` (a window of a wider buffer); both non-contiguous layouts keep autograd leaves."""
    if layout == "transposed" and tensor.dim() >= 2:
        return tensor.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "sliced":
        wide = torch.zeros(
            *tensor.shape[:-1], tensor.shape[-1] + 3, dtype=tensor.dtype, device=tensor.device
        )
        wide[..., 1:-2] = tensor
        return wide[..., 1:-2]
    return tensor.clone()


def upstream_view(grad: torch.Tensor, spec: CaseSpec, shape: tuple[int, ...]) -> torch.Tensor:
    """An upstream gradient shaped like the output, in the spec's memory pattern."""
    grad = grad.view(shape)
    if spec.upstream == "expanded" and grad.numel():
        return grad.reshape(-1)[:1].view([1] * len(shape) or []).expand(shape)
    if spec.upstream == "strided":
        wide = torch.zeros(*shape, 2, dtype=grad.dtype, device=grad.device)
        wide[..., 0] = grad
        return wide[..., 0]
    return grad


def _inputs(spec: CaseSpec, problem: Problem, ctx: Any) -> dict[str, Any]:
    start, stop = vocab_range(spec, ctx.tp_rank)
    shape = spec.target_shape()
    tied = spec.tied and spec.transform != "untie"
    leaf_hidden = problem.hidden_base if tied else problem.hidden
    # An untied rerun feeds lce a contiguous hidden, as the tied run's base + embedding is.
    layout = "contiguous" if spec.transform == "untie" else spec.layout
    hidden = with_layout(leaf_hidden.view(*shape, spec.hidden_size), layout)
    weight = with_layout(problem.weight[start:stop], spec.layout)
    targets = problem.targets.clone()
    temperature = effective_temperature(spec)
    if spec.fault == "target_ge_vocab":
        targets[-1] = spec.vocab
    elif spec.fault == "target_negative":
        targets[0] = -1  # negative, and not ignore_index (-100)
    elif spec.fault == "temperature_zero":
        temperature = 0.0
    elif spec.fault == "temperature_nan":
        temperature = float("nan")
    elif spec.fault == "hidden_size_mismatch":
        weight = torch.cat([weight, torch.ones_like(weight[:, :1])], dim=1)
    targets = targets.view(shape)
    if spec.fault == "targets_float":
        targets = targets.float()
    hidden.requires_grad_(spec.grads in ("both", "hidden", "twice"))
    weight.requires_grad_(spec.grads in ("both", "weight", "twice"))
    return {
        "hidden": hidden, "weight": weight, "targets": targets, "temperature": temperature,
        "vocab_start": explicit_vocab_start(spec, ctx.tp_rank), "tied": tied,
    }  # fmt: skip


def _head_hidden(spec: CaseSpec, problem: Problem, inputs: dict[str, Any]) -> torch.Tensor:
    """What lce receives as hidden: the leaf, or base + embedding of the (tied) weight leaf."""
    if not inputs["tied"]:
        return inputs["hidden"]
    flat = inputs["hidden"].reshape(-1, spec.hidden_size)
    return tied_hidden(flat, inputs["weight"], problem.embed_ids).view(inputs["hidden"].shape)


def _run(spec: CaseSpec, problem: Problem, ctx: Any) -> dict[str, Any]:
    inputs = _inputs(spec, problem, ctx)
    leaves = [inputs[k] for k in ("hidden", "weight") if inputs[k].requires_grad]
    before = {k: inputs[k].detach().clone() for k in ("hidden", "weight", "targets")}
    kwargs = {
        "ignore_index": IGNORE_INDEX, "temperature": inputs["temperature"],
        "tp_group": ctx.tp_group if spec.tp > 1 else None, "vocab_start": inputs["vocab_start"],
        "backend": spec.backend, "chunk_size": spec.chunk_size,
        "reduce_grad_hidden": spec.reduce_hidden,
    }  # fmt: skip
    shape = spec.target_shape()
    twice = spec.grads == "twice"
    grad_mode = torch.enable_grad() if leaves else torch.no_grad()
    with grad_mode:
        head = _head_hidden(spec, problem, inputs)
        out = lce.token_logprobs(head, inputs["weight"], inputs["targets"], **kwargs)
        result: dict[str, Any] = {"status": "ok", "logprobs": out.logprobs, "entropy": out.entropy}
        pairs = [(out.logprobs, upstream_view(problem.grad_logprob, spec, shape))]
        if problem.grad_entropy is not None:
            pairs.append((out.entropy, upstream_view(problem.grad_entropy, spec, shape)))
        result.update(_grads(pairs, inputs, leaves, "grad_", twice))
        head = _head_hidden(spec, problem, inputs)
        loss = lce.linear_cross_entropy(
            head, inputs["weight"], inputs["targets"], reduction=spec.reduction, **kwargs
        )
        result["loss"] = loss
        loss_grad = problem.grad_loss
        if spec.reduction == "none":
            loss_grad = upstream_view(loss_grad, spec, shape)
        result.update(_grads([(loss, loss_grad)], inputs, leaves, "loss_grad_", twice))
    result["inputs_unchanged"] = all(
        torch.equal(before[k], inputs[k].detach()) and before[k].dtype == inputs[k].dtype
        for k in before
    )
    result["dtypes"] = {k: str(v.dtype) for k, v in result.items() if isinstance(v, torch.Tensor)}
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in result.items()}


def _grads(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    inputs: dict[str, Any],
    leaves: list[torch.Tensor],
    prefix: str,
    twice: bool = False,
) -> dict[str, Any]:
    """Gradients of ``sum(output * upstream)`` w.r.t. the leaves that require grad; ``twice``:
    backward with ``retain_graph`` and again, returning the second and whether both agree."""
    if not leaves:
        return {}
    outputs, upstreams = zip(*pairs, strict=True)
    first = torch.autograd.grad(outputs, leaves, upstreams, allow_unused=True, retain_graph=twice)
    grads = torch.autograd.grad(outputs, leaves, upstreams, allow_unused=True) if twice else first
    named: dict[str, Any] = {}
    for name in ("hidden", "weight"):
        if inputs[name].requires_grad:
            grad = grads[[leaf is inputs[name] for leaf in leaves].index(True)]
            named[prefix + name] = grad if grad is not None else torch.zeros_like(inputs[name])
    if twice:
        named[prefix + "twice_equal"] = all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(first, grads, strict=True)
        )
    return named
