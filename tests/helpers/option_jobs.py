"""Worker-side jobs of the option tests: lce called on real gloo TP groups with logit options."""

from __future__ import annotations

from typing import Any

import torch

import lce
from tests.helpers.option_reference import leaf, make_problem, run_path, upstream
from verify.distributed import JobContext


def call_with_rank_options(payload: dict[str, Any], ctx: JobContext) -> dict[str, str]:
    """Every rank calls `lce.linear_cross_entropy` on the same tokens with its own shard and the
    keyword options ``payload["options"][tp_rank]`` (``payload.get("bias_rows")``: the rows of
    each rank's bias, its shard's 4 when right); returns the error each rank raised."""
    gen = torch.Generator().manual_seed(8)
    num_tokens, hidden_size, vocab_local = 5, 6, 4
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, requires_grad=True)
    weight = torch.randn(vocab_local * ctx.tp_size, hidden_size, generator=gen)
    targets = torch.randint(0, vocab_local * ctx.tp_size, (num_tokens,), generator=gen)
    start = ctx.tp_rank * vocab_local
    bias = None
    if payload.get("bias_rows") is not None:
        bias = torch.zeros(payload["bias_rows"][ctx.tp_rank])
    try:
        lce.linear_cross_entropy(
            hidden, weight[start : start + vocab_local], targets, bias=bias,
            tp_group=ctx.tp_group, backend=payload["backend"], **payload["options"][ctx.tp_rank],
        )  # fmt: skip
    except (TypeError, ValueError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": ""}


def run_options(payload: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """One rank of an option case: the shared problem (`option_reference.make_problem` with
    ``payload["problem"]``), this rank's rows of weight and bias (``payload["shards"]``: the
    ranks' sizes, passed with ``vocab_start``; None: equal shards, no vocab_start), `run_path` on
    ``payload["path"]``. Returns the outputs and the gradients, grad_weight and grad_bias this
    rank's rows."""
    problem = make_problem(**payload["problem"])
    vocab = problem.weight.shape[0]
    sizes = payload["shards"] or [vocab // ctx.tp_size] * ctx.tp_size
    start = sum(sizes[: ctx.tp_rank])
    rows = slice(start, start + sizes[ctx.tp_rank])
    leaves = (
        leaf(problem.hidden, torch.float32),
        leaf(problem.weight[rows], torch.float32),
        leaf(problem.bias[rows], torch.float32) if payload["with_bias"] else None,
    )
    call = {"tp_group": ctx.tp_group}
    if payload["shards"] is not None:
        call["vocab_start"] = start
    path = payload["path"]
    outputs, grads = run_path(
        path, payload["backend"], payload["options"], leaves, problem.targets,
        upstream(problem, path), **call,
    )  # fmt: skip
    detached = [None if g is None else g.detach() for g in grads]
    return {"outputs": [o.detach() for o in outputs], "grads": detached}
