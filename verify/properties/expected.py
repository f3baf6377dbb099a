"""What a case should give: the float64 reference R and the stock baseline B of a spec.

`expected(spec)` materializes R and B on the spec's global problem, flattened like
`verify.execution.outcome.assemble` flattens what the ranks gave, so every property compares like
with like. `compute_ahead(spec)` starts that in a background thread while the spec's kernel runs
on a GPU worker (the two then overlap; R's bits are the same in any thread).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import torch

from verify.cases.build import TIE_SCALE, Problem, build
from verify.cases.rank_inputs import effective_temperature
from verify.cases.spec import CaseSpec
from verify.numerics.reference import (
    IGNORE_INDEX,
    Reference,
    baseline,
    loss_upstream_grad,
    reference,
)
from verify.running import stage_timing


@dataclass(frozen=True)
class Expected:
    """float64 R and B values of every output, flattened like `assemble`'s (``[N]``, ``[N, H]``)."""

    ref: dict[str, torch.Tensor]
    base: dict[str, torch.Tensor]
    problem: Problem


_BACKGROUND = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lce-expected")
_ahead: dict[CaseSpec, Future[Expected]] = {}  # the latest `compute_ahead`, until it is read


def expected(spec: CaseSpec) -> Expected:
    """R and B of a valid ``spec`` (cached: many properties check the same spec)."""
    ahead = _ahead.pop(spec, None)
    return ahead.result() if ahead is not None else _expected(spec)


def compute_ahead(spec: CaseSpec) -> None:
    """Start `expected` of a valid ``spec`` in the background (one spec at a time: the last)."""
    _ahead.clear()
    _ahead[spec] = _BACKGROUND.submit(_expected, spec)


@lru_cache(maxsize=64)
def _expected(spec: CaseSpec) -> Expected:
    with stage_timing.stage("build"):
        problem = build(spec)
    valid = problem.targets != IGNORE_INDEX
    # float64: dividing the fp32 upstream by the valid count in fp32 would round it (1/3).
    loss_upstream = loss_upstream_grad(valid, spec.reduction, problem.grad_loss.double())
    ref: dict[str, torch.Tensor] = {}
    base: dict[str, torch.Tensor] = {}
    for fn, out, name in ((reference, ref, "reference"), (baseline, base, "baseline")):
        args = (problem.hidden, problem.weight, problem.targets)
        kw = {"ignore_index": IGNORE_INDEX, "temperature": effective_temperature(spec)}
        with stage_timing.stage(name):
            tokens = fn(
                *args, grad_logprob=problem.grad_logprob, grad_entropy=problem.grad_entropy, **kw
            )
            loss_run = fn(*args, grad_logprob=loss_upstream, **kw)
            out.update(_outputs(spec, problem, tokens, ""))
            out["loss"] = tokens.loss(spec.reduction)
            out.update(_outputs(spec, problem, loss_run, "loss_"))
            del out["loss_logprobs"], out["loss_entropy"]
    return Expected(ref, base, problem)


def _outputs(spec: CaseSpec, problem: Problem, run: Reference, prefix: str) -> dict:
    grad_hidden, grad_weight = run.grad_hidden, run.grad_weight
    if spec.tied and spec.transform != "untie":
        # One weight used as embedding and LM head: its gradient is the sum of both uses.
        embed = torch.zeros_like(grad_weight).index_add_(0, problem.embed_ids, grad_hidden)
        grad_weight = grad_weight + TIE_SCALE * embed
    return {
        f"{prefix}logprobs": run.logprobs,
        f"{prefix}entropy": run.entropy,
        f"{prefix}grad_hidden": grad_hidden,
        f"{prefix}grad_weight": grad_weight,
    }
