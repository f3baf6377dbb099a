"""Worker-side jobs for the TP tests: calls of lce that its contract refuses (a rank's inputs from
the harness without the ``vocab_start`` unequal shards need; ranks disagreeing on the call)."""

from __future__ import annotations

from typing import Any

import torch

import lce
from verify.cases.build import build
from verify.cases.rank_inputs import rank_inputs
from verify.cases.spec import CaseSpec
from verify.distributed import JobContext


def without_vocab_start(payload: str, ctx: JobContext) -> None:
    """``payload``: CaseSpec JSON; lce must refuse the rank's shard (it raises in the worker)."""
    spec = CaseSpec.from_json(payload)
    inputs = rank_inputs(spec, build(spec), ctx.tp_rank)
    lce.token_logprobs(inputs.hidden, inputs.weight, inputs.targets, tp_group=ctx.tp_group)


def run_disagreeing_call(payload: dict[str, Any], ctx: JobContext) -> dict[str, str]:
    """Ranks call lce with arguments they disagree on (``payload["disagree"]``): ``tokens`` (the
    last rank has one token fewer), ``vocab_start`` (only rank 0 passes it) or ``targets`` (the
    last rank's targets have a wrong shape). Returns the error each rank raised."""
    gen = torch.Generator().manual_seed(5)
    num_tokens, hidden_size, vocab_local = 6, 8, 5
    last = ctx.tp_rank == ctx.tp_size - 1
    hidden = torch.randn(num_tokens, hidden_size, generator=gen)
    targets = torch.randint(0, vocab_local * ctx.tp_size, (num_tokens,), generator=gen)
    weight = torch.randn(vocab_local * ctx.tp_size, hidden_size, generator=gen)
    start = ctx.tp_rank * vocab_local
    weight = weight[start : start + vocab_local]
    disagree = payload["disagree"]
    if disagree == "tokens" and last:
        hidden, targets = hidden[1:], targets[1:]
    if disagree == "targets" and last:
        targets = targets[1:]
    vocab_start = start if disagree == "vocab_start" and ctx.tp_rank == 0 else None
    try:
        lce.linear_cross_entropy(
            hidden.requires_grad_(), weight, targets, tp_group=ctx.tp_group,
            vocab_start=vocab_start, backend=payload["backend"],
        )  # fmt: skip
    except ValueError as error:
        return {"error": str(error)}
    return {"error": ""}


def run_double_backward(payload: dict[str, Any], ctx: JobContext) -> dict[str, str]:
    """A backward with create_graph=True under TP; returns the error each rank raised."""
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(4, 8, generator=gen, requires_grad=True)
    weight = torch.randn(5, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, 5 * ctx.tp_size, (4,), generator=gen)
    out = lce.token_logprobs(hidden, weight, targets, tp_group=ctx.tp_group, backend="torch")
    try:
        torch.autograd.grad(out.logprobs.sum(), weight, create_graph=True)
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": ""}
