"""A worker-side job for the TP tests: every rank rebuilds the same global problem from its seed,
takes its vocab shard, runs lce forward and backward, and returns its outputs and gradient shard."""

from __future__ import annotations

from typing import Any

import torch

import lce
from tests.problems import make_problem
from verify.distributed import JobContext

LOSS_GRAD = -0.61  # upstream gradient of the scalar loss: not 1, and negative
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def shard_bounds(sizes: list[int], tp_rank: int) -> tuple[int, int]:
    start = sum(sizes[:tp_rank])
    return start, start + sizes[tp_rank]


def run_tp_case(payload: dict[str, Any], ctx: JobContext) -> dict[str, torch.Tensor]:
    """``payload``: seed, T, H, V, dtype, temperature, backend, shard sizes, explicit_start, and
    optionally ``reduction`` ("sum"/"mean": run `lce.linear_cross_entropy` instead)."""
    dtype = DTYPES[payload["dtype"]]
    problem = make_problem(payload["T"], payload["H"], payload["V"], dtype, seed=payload["seed"])
    sizes = payload["sizes"]
    start, end = shard_bounds(sizes, ctx.tp_rank)
    hidden = problem.hidden.clone().requires_grad_()
    weight = problem.weight[start:end].clone().requires_grad_()
    options = dict(
        temperature=payload["temperature"],
        tp_group=ctx.tp_group,
        vocab_start=start if payload["explicit_start"] else None,
        backend=payload["backend"],
        chunk_size=8,
    )
    reduction = payload.get("reduction")
    if reduction is not None:  # the scalar-loss path (gradients computed in forward)
        loss = lce.linear_cross_entropy(
            hidden, weight, problem.targets, reduction=reduction, **options
        )
        loss.backward(torch.tensor(LOSS_GRAD))
        outputs = {"loss": loss.detach()}
    else:
        out = lce.token_logprobs(hidden, weight, problem.targets, **options)
        torch.autograd.backward(
            [out.logprobs, out.entropy], [problem.grad_logprob, problem.grad_entropy]
        )
        outputs = {"logprobs": out.logprobs.detach(), "entropy": out.entropy.detach()}
    return {**outputs, "grad_hidden": hidden.grad, "grad_weight": weight.grad}
