"""What a case should give and what it gave: R and B for a spec, and the ranks' results assembled.

`expected(spec)` materializes the float64 reference R and the stock baseline B on the spec's global
problem; `assemble(spec, results)` turns per-rank job results into global outputs (grad_weight
shards concatenated) so every property compares like with like.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from verify.cases.build import IGNORE_INDEX, TIE_SCALE, Problem, build, effective_temperature
from verify.cases.spec import CaseSpec
from verify.numerics.reference import Reference, baseline, loss_upstream_grad, reference

# Which tolerances.yaml output judges each job output.
TOLERANCE_OUTPUT = {
    "logprobs": "logprobs",
    "entropy": "entropy",
    "loss": "loss",
    "grad_hidden": "grad_hidden",
    "grad_weight": "grad_weight",
    "loss_grad_hidden": "grad_hidden",
    "loss_grad_weight": "grad_weight",
}
PER_RANK_SAME = ("logprobs", "entropy", "loss", "grad_hidden", "loss_grad_hidden")


@dataclass(frozen=True)
class Expected:
    """float64 R and B values of every output, flattened like `assemble`'s (``[N]``, ``[N, H]``)."""

    ref: dict[str, torch.Tensor]
    base: dict[str, torch.Tensor]
    problem: Problem


@lru_cache(maxsize=64)
def expected(spec: CaseSpec) -> Expected:
    """R and B of a valid ``spec`` (cached: many properties check the same spec)."""
    problem = build(spec)
    valid = problem.targets != IGNORE_INDEX
    # float64: dividing the fp32 upstream by the valid count in fp32 would round it (1/3).
    loss_upstream = loss_upstream_grad(valid, spec.reduction, problem.grad_loss.double())
    ref: dict[str, torch.Tensor] = {}
    base: dict[str, torch.Tensor] = {}
    for fn, out in ((reference, ref), (baseline, base)):
        args = (problem.hidden, problem.weight, problem.targets)
        kw = {"ignore_index": IGNORE_INDEX, "temperature": effective_temperature(spec)}
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


@dataclass(frozen=True)
class KernelRun:
    """Global outputs of one run (rank 0's per-token values, all grad_weight shards), or a refusal.

    ``ranks_agree``: every rank returned bit-identical per-token outputs and grad_hidden.
    ``twice_equal``: for ``grads="twice"``, the second backward repeated the first (else True).
    """

    status: str
    outputs: dict[str, torch.Tensor]
    dtypes: dict[str, str]
    inputs_unchanged: bool
    ranks_agree: bool
    error: str = ""
    twice_equal: bool = True


def assemble(spec: CaseSpec, results: list[dict[str, Any]]) -> KernelRun:
    """Merge the per-rank job results (index = TP rank) into one `KernelRun`."""
    statuses = {r["status"] for r in results}
    if statuses != {"ok"}:
        raised = [r for r in results if r["status"] != "ok"]
        error = f"{raised[0]['error_type']}: {raised[0]['error']}"
        status = "raised" if statuses == {"raised"} else "mixed"
        return KernelRun(status, {}, {}, True, status != "mixed", error)
    first = results[0]
    outputs: dict[str, torch.Tensor] = {}
    for name in TOLERANCE_OUTPUT:
        if name not in first:
            continue
        if name.endswith("grad_weight"):
            value = torch.cat([r[name] for r in results], dim=0)
        elif name.endswith("grad_hidden") and not spec.reduce_hidden:
            # Partial per rank (sequence parallel): the caller's reduce-scatter sums them.
            value = torch.stack([r[name].double() for r in results]).sum(0).to(first[name].dtype)
        else:
            value = first[name]
        if name.endswith("grad_hidden"):
            value = value.reshape(-1, spec.hidden_size)
        elif name in ("logprobs", "entropy") or (name == "loss" and spec.reduction == "none"):
            value = value.reshape(-1)
        outputs[name] = value
    same = [n for n in PER_RANK_SAME if spec.reduce_hidden or not n.endswith("grad_hidden")]
    agree = all(_bit_equal(r[n], first[n]) for r in results[1:] for n in same if n in r)
    unchanged = all(r["inputs_unchanged"] for r in results)
    twice = all(v for r in results for k, v in r.items() if k.endswith("twice_equal"))
    return KernelRun("ok", outputs, first["dtypes"], unchanged, agree, twice_equal=twice)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num())
