"""What a case gave: the ranks' job results assembled into one `KernelRun`.

`assemble(spec, results)` turns per-rank results into global outputs (grad_weight shards
concatenated, partial grad_hidden summed), so every property compares like with like.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verify.cases.spec import CaseSpec

# Which tolerances.yaml output judges each job output.
TOLERANCE_OUTPUT = {
    "logprobs": "logprobs",
    "entropy": "entropy",
    "loss": "loss",
    "grad_hidden": "grad_hidden",
    "grad_weight": "grad_weight",
    "grad_bias": "grad_weight",  # the bias is a weight column against a hidden of ones
    "loss_grad_hidden": "grad_hidden",
    "loss_grad_weight": "grad_weight",
    "loss_grad_bias": "grad_weight",
}
# Outputs sharded over the vocabulary like the weight's rows: the ranks' parts are concatenated.
VOCAB_SHARDED = ("grad_weight", "grad_bias", "loss_grad_weight", "loss_grad_bias")
PER_RANK_SAME = ("logprobs", "entropy", "loss", "grad_hidden", "loss_grad_hidden")


@dataclass(frozen=True)
class KernelRun:
    """Global outputs of one run (rank 0's per-token values, all grad_weight shards), or a refusal.

    ``dtypes``: each output's dtype as the implementation returned it (rank 0's), before the
    harness's exact upcast of an input-dtype contract's log-probs, entropy and loss.
    ``ranks_agree``: every rank returned bit-identical per-token outputs and grad_hidden.
    ``twice_equal``: for ``grads="twice"``, the second backward repeated the first (else True).
    ``grad_layouts``: each DTensor leaf's gradient that was not a DTensor of the leaf's mesh and
    placements, by rank (`verify.execution.dtensor_leaves`).
    """

    status: str
    outputs: dict[str, torch.Tensor]
    dtypes: dict[str, str]
    inputs_unchanged: bool
    ranks_agree: bool
    error: str = ""
    twice_equal: bool = True
    grad_layouts: tuple[str, ...] = ()


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
        if name in VOCAB_SHARDED:
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
    layouts = tuple(
        f"rank {rank} {key.removesuffix('grad_layouts')}{line}"
        for rank, r in enumerate(results)
        for key, lines in r.items()
        if key.endswith("grad_layouts")
        for line in lines
    )
    return KernelRun(
        "ok", outputs, first["dtypes"], unchanged, agree, twice_equal=twice, grad_layouts=layouts
    )


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num())
