"""A worker-side job for the TP tests: every rank rebuilds the same global problem from its seed,
takes its vocab shard, runs lce forward and backward, and returns its outputs and gradient shard."""

from __future__ import annotations

from typing import Any

import torch

import lce
from tests.problems import make_problem
from verify.distributed import JobContext

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def shard_bounds(sizes: list[int], tp_rank: int) -> tuple[int, int]:
    start = sum(sizes[:tp_rank])
    return start, start + sizes[tp_rank]


def run_tp_case(payload: dict[str, Any], ctx: JobContext) -> dict[str, torch.Tensor]:
    """``payload``: seed, T, H, V, dtype, temperature, backend, shard sizes, explicit_start."""
    dtype = DTYPES[payload["dtype"]]
    problem = make_problem(payload["T"], payload["H"], payload["V"], dtype, seed=payload["seed"])
    sizes = payload["sizes"]
    start, end = shard_bounds(sizes, ctx.tp_rank)
    hidden = problem.hidden.clone().requires_grad_()
    weight = problem.weight[start:end].clone().requires_grad_()
    out = lce.token_logprobs(
        hidden,
        weight,
        problem.targets,
        temperature=payload["temperature"],
        tp_group=ctx.tp_group,
        vocab_start=start if payload["explicit_start"] else None,
        backend=payload["backend"],
        chunk_size=8,
    )
    torch.autograd.backward(
        [out.logprobs, out.entropy], [problem.grad_logprob, problem.grad_entropy]
    )
    return {
        "logprobs": out.logprobs.detach(),
        "entropy": out.entropy.detach(),
        "grad_hidden": hidden.grad,
        "grad_weight": weight.grad,
    }
