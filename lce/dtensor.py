"""DTensor weights (DTensor tensor parallelism, FSDP2): a call's plain-tensor arguments.

A weight sharded on dim 0 over a one-dimensional mesh is a vocab shard: the call runs lce's TP path
on the mesh's process group with this rank's local rows and their global offset as ``vocab_start``
(targets stay global ids). A replicated weight runs locally. ``weight.to_local()`` is
differentiable, so the weight's gradient comes back as a DTensor of the weight's placement. Any
other layout is refused, and so are DTensor activations.

FSDP2 also shards parameters on dim 0, over a *data-parallel* mesh whose ranks hold different
tokens: taken as vocab-parallel that would be silently wrong. Vocab parallelism needs the same
hidden and targets on every rank, so a Shard(0) call first checks that (`require_same_tokens`)
and names FSDP's own fix where the ranks differ.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.distributed as dist

from lce.tp import CallShape, agree_on_call, usable_group
from lce.validation import check_inputs

# FSDP2's way to hand a module's whole weight to code outside the module's forward.
FSDP_FIX = (
    "for an FSDP2 (fully_shard) model, gather the weight through FSDP before the loss: call "
    "model.lm_head.unshard() (FSDPModule.unshard; FSDP reduce-scatters its gradient after "
    "backward), or keep the LM head's weight in the root FSDP unit (left unsharded after forward)"
)


class LocalCall(NamedTuple):
    """The arguments lce runs with: plain tensors, and the TP group and offset a DTensor implies."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    tp_group: dist.ProcessGroup | None
    vocab_start: int | None
    grad_weight_into: torch.Tensor | None


def is_dtensor(value: object) -> bool:
    """Without ``torch.distributed.tensor`` imported no DTensor exists (and lce does not pay the
    import)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(value, dtensor)


def local_call(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int | None,
    grad_weight_into: torch.Tensor | None = None,
) -> LocalCall:
    """The call's arguments as lce takes them: unchanged unless ``weight`` is a DTensor (then a
    ``bias`` must be a DTensor laid out as the weight's rows, and its local shard is used).

    Raises `TypeError` for DTensor ``hidden``/``targets`` and `ValueError` for a weight layout lce
    does not take, a ``tp_group``/``vocab_start`` beside a DTensor weight (the mesh says both), a
    ``bias`` or ``grad_weight_into`` whose layout is not the weight's, or (Shard(0)) ranks whose
    tokens differ.
    """
    for name, value in (("hidden", hidden), ("targets", targets)):
        if is_dtensor(value):
            raise TypeError(
                f"{name} is a DTensor (placements {value.placements}); lce takes plain "
                f"activations, the same on every rank of a vocab-parallel weight's mesh: pass "
                f"{name}.full_tensor() (differentiable), or {name}.to_local() where it is Replicate"
            )
    if not is_dtensor(weight):
        for name, value in (("bias", bias), ("grad_weight_into", grad_weight_into)):
            if is_dtensor(value):
                raise ValueError(
                    f"{name} is a DTensor but weight is not; pass {name} for weight's own "
                    "(local) rows as a plain tensor"
                )
        return LocalCall(weight, bias, tp_group, vocab_start, grad_weight_into)
    if tp_group is not None or vocab_start is not None:
        raise ValueError(
            "weight is a DTensor: its device mesh gives the TP group and each rank's vocab_start; "
            "pass neither tp_group nor vocab_start with it (or pass weight.to_local() with them)"
        )
    buffer = _local_buffer(grad_weight_into, weight)
    local_bias = None
    if bias is not None:
        _require_layout("bias", bias, weight, "its local shard is this rank's bias")
        local_bias = bias.to_local()  # differentiable: the gradient comes back as a DTensor
    if all(placement.is_replicate() for placement in weight.placements):
        return LocalCall(weight.to_local(), local_bias, None, None, buffer)
    if not _vocab_sharded(weight):
        raise ValueError(_layout_error(weight))
    local = weight.to_local()
    group = weight.device_mesh.get_group()
    require_same_tokens(hidden, local, targets, group)
    return LocalCall(local, local_bias, group, _vocab_start(weight, local), buffer)


def _vocab_sharded(weight: torch.Tensor) -> bool:
    """Shard(0) over a one-dimensional mesh (`type` is exact: a strided shard is refused)."""
    from torch.distributed.tensor import Shard  # imported already: weight is a DTensor

    mesh, placements = weight.device_mesh, weight.placements
    return mesh.ndim == 1 and type(placements[0]) is Shard and placements[0].dim == 0


def _layout_error(weight: torch.Tensor) -> str:
    mesh = weight.device_mesh
    return (
        f"weight is a DTensor with placements {weight.placements} on a {mesh.ndim}-D device "
        "mesh; lce takes a vocab-parallel LM head, Shard(0) on a 1-D mesh (each rank whole rows "
        "of the vocabulary), or a replicated one: redistribute it, e.g. "
        "weight.redistribute(mesh, [Shard(0)]) on a 1-D mesh, or pass weight.full_tensor()"
    )


def _vocab_start(weight: torch.Tensor, local: torch.Tensor) -> int:
    """This rank's first global row, from the DTensor's own sharding (uneven shards included)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        weight.shape, weight.device_mesh, weight.placements
    )
    if tuple(shape) != tuple(local.shape):
        raise ValueError(
            f"weight's local shard is {tuple(local.shape)} but its DTensor layout says "
            f"{tuple(shape)}; build it with distribute_tensor or DTensor.from_local(..., shape=, "
            "stride=) over torch.chunk's row split"
        )
    return int(offset[0])


def _local_buffer(buffer: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor | None:
    """grad_weight_into's local shard: the buffer must be laid out as the DTensor weight."""
    if buffer is None:
        return None
    _require_layout("grad_weight_into", buffer, weight, "its local shard receives this rank's rows")
    return buffer.to_local()


def _require_layout(name: str, value: torch.Tensor, weight: torch.Tensor, why: str) -> None:
    """``value`` must be a DTensor on the weight's mesh with its placements."""
    if not (
        is_dtensor(value)
        and value.device_mesh == weight.device_mesh
        and tuple(value.placements) == tuple(weight.placements)
    ):
        raise ValueError(
            f"with a DTensor weight (placements {weight.placements}), {name} must be a DTensor "
            f"on the weight's mesh with its placements ({why})"
        )


def require_same_tokens(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup
) -> None:
    """Raise on every rank of ``group`` unless all pass the same hidden and targets.

    Vocab parallelism computes one softmax over the ranks' shards per token, so the ranks must hold
    the same tokens; FSDP2's Shard(0) weights live on a data-parallel mesh where they do not. First
    the ranks agree on the call's shape (`agree_on_call`, which also raises a rank's own argument
    error on every rank), then compare a fingerprint of the tokens (one MAX all-reduce of 8 ints).
    """
    group = usable_group(group)
    if group is None:
        return
    try:
        check_inputs(hidden, weight, targets)
    except (TypeError, ValueError) as error:
        agree_on_call(group, None, error)
    # The options are agreed on by the call itself (`lce.api`); here only the tokens' shape.
    agree_on_call(group, CallShape(targets.numel(), weight.shape[0], True, logit_key=0), None)
    fingerprint = token_fingerprint(hidden, targets)
    if dist.get_backend(group) != "nccl":
        fingerprint = fingerprint.cpu()
    packed = torch.cat([fingerprint, -fingerprint])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    most, fewest = packed.view(2, -1)
    if not torch.equal(most, -fewest):
        raise ValueError(
            "weight is a DTensor sharded on dim 0, which lce runs vocab-parallel over its mesh, "
            "but the mesh's ranks passed different hidden or targets (vocab parallelism needs the "
            f"same tokens on every rank); {FSDP_FIX}"
        )


# Integer views of each float dtype's bits: sums of bits are exact and independent of order.
_BITS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def token_fingerprint(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """int64 ``[4]``: per token its id and the sum of its hidden row's bit patterns, each summed
    plain and weighted by position. Integer sums (wrapping) do not depend on the order of
    reduction, so equal tokens give equal fingerprints on any layout."""
    rows = hidden.detach().reshape(-1, hidden.shape[-1])
    row_bits = rows.view(_BITS[rows.dtype]).sum(dim=1, dtype=torch.int64)
    per_token = torch.stack([targets.reshape(-1).to(torch.int64), row_bits])
    position = torch.arange(1, per_token.shape[1] + 1, device=per_token.device)
    return torch.cat([per_token.sum(dim=1), (per_token * position).sum(dim=1)])
