"""DTensor weights for a case (`CaseSpec.dtensor`): the rank's weight and bias as DTensor leaves on
a one-dimensional mesh over the rank's TP group, and their gradients back as local tensors.

``shard0``: this rank's rows (torch.chunk's split, `CaseSpec.shard_bounds`) as Shard(0) of the
global ``[V, H]``; ``replicate``: the whole head on every rank. The leaves are DTensors, as a
DTensor model's parameters are, so a gradient comes back as whatever the implementation hands
autograd: `local_grads` says where that is not a DTensor of the leaf's mesh and placements, and
returns this rank's rows (a replicated head's gradient cut to the rank's shard, so the ranks'
parts assemble as every case's do).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import torch
import torch.distributed as dist

from lce.dtensor import is_dtensor as _is_dtensor
from verify.cases.build import Problem
from verify.cases.layouts import with_layout
from verify.cases.rank_inputs import RankInputs, vocab_range
from verify.cases.spec import CaseSpec

# DTensor is imported only where a case asks for it (the import costs a second per worker).


def dtensor_inputs(
    spec: CaseSpec, inputs: RankInputs, problem: Problem, group: dist.ProcessGroup | None
) -> RankInputs:
    """``inputs`` with weight and bias as DTensor leaves of ``spec.dtensor`` (unchanged for
    ``"none"``) on a mesh over ``group`` (None: a one-rank world in this process)."""
    if spec.dtensor == "none":
        return inputs
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = _mesh(group or _own_world(), torch.device(inputs.weight.device).type)
    if spec.dtensor == "shard0":
        placement, weight, bias = Shard(0), inputs.weight, inputs.bias
    else:
        placement = Replicate()
        weight = with_layout(problem.weight, spec.layout)
        bias = None if problem.bias is None else problem.bias.clone()

    def leaf(local: torch.Tensor | None, rows_of: torch.Tensor) -> torch.Tensor | None:
        if local is None:
            return None
        shape = (spec.vocab, *local.shape[1:]) if spec.dtensor == "shard0" else local.shape
        stride = torch.empty(shape, device="meta").stride()
        wrapped = DTensor.from_local(
            local.detach(), mesh, [placement], run_check=False, shape=shape, stride=stride
        )
        return wrapped.requires_grad_(rows_of.requires_grad)

    return replace(inputs, weight=leaf(weight, inputs.weight), bias=leaf(bias, inputs.weight))


def local_grads(
    spec: CaseSpec,
    tp_rank: int,
    grads: dict[str, torch.Tensor | None],
    leaves: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Each leaf's gradient (zeros where autograd gave none) as this rank's local rows, and a line
    for each DTensor leaf whose gradient is not a DTensor of its mesh and placements."""
    start, stop = vocab_range(spec, tp_rank)
    out, wrong = {}, []
    for name, grad in grads.items():
        leaf = leaves[name]
        if not _is_dtensor(leaf):
            out[name] = grad if grad is not None else torch.zeros_like(leaf)
            continue
        if grad is None:
            grad = torch.zeros_like(leaf.to_local())
        elif not _is_dtensor(grad):
            wrong.append(f"{name}: a {type(grad).__name__}, its leaf a DTensor {leaf.placements}")
        elif grad.device_mesh != leaf.device_mesh or grad.placements != leaf.placements:
            wrong.append(f"{name}: placements {grad.placements}, its leaf's {leaf.placements}")
        local = grad.to_local() if _is_dtensor(grad) else grad
        out[name] = local[start:stop] if spec.dtensor == "replicate" else local
    return out, wrong


@cache
def _mesh(group: dist.ProcessGroup, device_type: str):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type)


def _own_world() -> dist.ProcessGroup:
    """A gloo world of this process alone (a TP = 1 case run without a pool), made once."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError(
            "a DTensor case without a pool needs a one-rank world; this process is in a world of "
            f"{dist.get_world_size()}: run it on a pool"
        )
    return dist.group.WORLD
