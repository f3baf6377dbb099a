"""Peer oracles: lce must be no worse than 2x an installed production peer (the peer plays B).

`torch_peer`: ``torch.nn.functional.linear_cross_entropy`` on the same (cast) inputs, in the driver.
`megatron_peer`: megatron-core's ``vocab_parallel_cross_entropy`` on materialized logits shards,
run on the pool's TP group (real collectives), equal shards only (megatron's own limit); it does
not apply where megatron-core is not installed, and megatron-core raising is the harness's error
(a peer that raised says nothing about lce), never lce's failure.
"""

from __future__ import annotations

import importlib.util
import warnings
from functools import lru_cache
from types import ModuleType
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verify.cases.build import build
from verify.cases.rank_inputs import effective_temperature, vocab_range
from verify.cases.spec import OPTION_DEFAULTS, OPTION_FIELDS, CaseSpec
from verify.distributed.errors import WorkerError
from verify.execution import stage_timing
from verify.execution.runner import Runner
from verify.numerics.reference import loss_upstream_grad
from verify.properties.oracle import oracle
from verify.properties.verdict import PropertyVerdict, refused, tolerance_check, tolerance_for

MEGATRON_JOB = "verify.properties.peers:megatron_job"


def _against_peer(
    prop: str, spec: CaseSpec, runner: Runner, peer: dict[str, torch.Tensor]
) -> list[PropertyVerdict]:
    run = runner.run(spec)
    if run.status != "ok":
        return [refused(prop, spec, run.error)]
    ref = oracle(spec).ref
    return [
        tolerance_check(
            prop,
            spec,
            name,
            run.outputs[name],
            ref[name],
            value,
            tolerance_for(spec, name),
            returned=run.dtypes.get(name),
        )
        for name, value in peer.items()
        if name in run.outputs
    ]


# The model options torch's linear_cross_entropy takes (``linear_bias``, ``label_smoothing``).
TORCH_PEER_OPTIONS = ("bias", "label_smoothing")


def torch_peer_applies(spec: CaseSpec) -> bool:
    """torch has the peer (>= 2.13) and the case is one it computes (untied, no model option
    but a bias and label smoothing)."""
    options = all(
        getattr(spec, name) == OPTION_DEFAULTS[name]
        for name in OPTION_FIELDS
        if name not in TORCH_PEER_OPTIONS
    )
    plain = options and not spec.tied and spec.transform == "none"
    return torch_has_peer() and plain


def torch_has_peer() -> bool:
    """This PyTorch has ``F.linear_cross_entropy`` (2.13 on)."""
    return hasattr(F, "linear_cross_entropy")


def torch_peer(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """lce's loss and its gradients vs R, with torch's linear_cross_entropy as the baseline."""
    with stage_timing.stage("peer"):
        problem = build(spec)
        hidden = problem.hidden.to(problem.weight.dtype).requires_grad_()
        leaves = {"hidden": hidden, "weight": problem.weight.clone().requires_grad_()}
        if problem.bias is not None:
            leaves["bias"] = problem.bias.clone().requires_grad_()
        loss = F.linear_cross_entropy(
            hidden, leaves["weight"], problem.targets, linear_bias=leaves.get("bias"),
            reduction=spec.reduction, ignore_index=problem.ignore_index,
            label_smoothing=spec.label_smoothing,
        )  # fmt: skip
        peer = {"loss": loss.detach().reshape(-1) if spec.reduction == "none" else loss.detach()}
        if spec.grads != "none" and spec.num_tokens:
            grads = torch.autograd.grad(loss, tuple(leaves.values()), problem.grad_loss)
            peer.update({f"loss_grad_{name}": g for name, g in zip(leaves, grads, strict=True)})
    return _against_peer("torch_peer", spec, runner, peer)


def megatron_peer_applies(spec: CaseSpec) -> bool:
    """megatron-core is installed and computes the case: equal shards (its own limit), untied,
    at least one token, no model option but the temperature (its label smoothing rescales
    epsilon by V / (V - 1), another definition than lce's and PyTorch's)."""
    plain = not spec.tied and spec.transform == "none" and spec.num_tokens > 0
    plain = plain and not spec.has_options
    return plain and spec.even_shards and megatron_installed()


def megatron_peer(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """lce's log-probs and loss gradients vs R, megatron-core as the baseline (TP on the pool)."""
    if runner.pool is None or spec.tp not in runner.tp_sizes:
        return []  # a runner in this process (tests): no TP group to run megatron-core on
    with stage_timing.stage("peer"):
        try:
            results = runner.pool.run(MEGATRON_JOB, {"spec": spec.to_json()}, tp=spec.tp)
        except WorkerError as error:  # the peer's job raised: a harness verdict, not lce's
            raised = error.traceback.strip().splitlines()[-1] if error.traceback.strip() else ""
            message = f"megatron-core's job raised on rank {error.rank}: {raised}"
            raise RuntimeError(message) from error
    peer = {"logprobs": results[0]["logprobs"]}
    if "loss_grad_hidden" in results[0]:
        peer["loss_grad_hidden"] = results[0]["loss_grad_hidden"]
    if "loss_grad_weight" in results[0]:
        peer["loss_grad_weight"] = torch.cat([r["loss_grad_weight"] for r in results])
    return _against_peer("megatron_peer", spec, runner, peer)


@lru_cache(maxsize=1)
def megatron_installed() -> bool:
    """megatron-core is importable here (the workers share this environment)."""
    return importlib.util.find_spec("megatron") is not None and (
        importlib.util.find_spec("megatron.core") is not None
    )


def megatron_job(payload: dict[str, Any], ctx: Any) -> dict[str, torch.Tensor]:
    """On each TP rank: materialized logits of this rank's shard through megatron-core."""
    cross_entropy = megatron_cross_entropy()
    spec = CaseSpec.from_json(payload["spec"])
    problem = build(spec)
    start, stop = vocab_range(spec, ctx.tp_rank)
    hidden = problem.hidden.clone().requires_grad_(spec.grads in ("both", "hidden", "twice"))
    weight = (
        problem.weight[start:stop].clone().requires_grad_(spec.grads in ("both", "weight", "twice"))
    )
    valid = problem.valid
    targets = torch.where(valid, problem.targets, torch.zeros_like(problem.targets))
    group = {
        "get_tensor_model_parallel_group": lambda: ctx.tp_group,
        "get_tensor_model_parallel_rank": lambda: ctx.tp_rank,
        "get_tensor_model_parallel_world_size": lambda: ctx.tp_size,
    }
    with mock.patch.multiple(cross_entropy, **group), torch.enable_grad():
        logits = (hidden.to(weight.dtype) @ weight.T).float() / effective_temperature(spec)
        token_loss = cross_entropy.vocab_parallel_cross_entropy(logits, targets)
        out = {"logprobs": torch.where(valid, -token_loss, 0.0).detach()}
        leaves = [t for t in (hidden, weight) if t.requires_grad]
        if leaves:
            upstream = loss_upstream_grad(valid, spec.reduction, problem.grad_loss)
            grads = dict(
                zip(("hidden", "weight"), _grads(token_loss, hidden, weight, upstream), strict=True)
            )
            if grads["hidden"] is not None:
                partial = grads["hidden"].float()
                dist.all_reduce(partial, group=ctx.tp_group)
                out["loss_grad_hidden"] = partial.to(hidden.dtype)
            if grads["weight"] is not None:
                out["loss_grad_weight"] = grads["weight"]
    return out


# What megatron-core warns at import when Transformer Engine and Apex are absent (four times per
# worker, again after each pool rebuild): expected here, where only its cross-entropy is used.
MEGATRON_IMPORT_WARNING = "Transformer Engine and Apex are not installed"


def megatron_cross_entropy() -> ModuleType:
    """``megatron.core.tensor_parallel.cross_entropy``, imported without megatron-core's warnings
    about Transformer Engine and Apex (only those: any other warning still shows)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=MEGATRON_IMPORT_WARNING, category=UserWarning)
        from megatron.core.tensor_parallel import cross_entropy
    return cross_entropy


def _grads(loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, upstream: torch.Tensor):
    leaves = [t for t in (hidden, weight) if t.requires_grad]
    grads = iter(torch.autograd.grad(loss, leaves, upstream))
    return [next(grads) if t.requires_grad else None for t in (hidden, weight)]
