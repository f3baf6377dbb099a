"""A third party's vocab-parallel cross-entropy, written as Megatron's is (a sum over the group
whose gradient is the identity, hidden's gradient summed over the group unless the caller asks
for its partial), with the shard's first id from `Call.first_id`. `shard_end_owned` is the same
with an off-by-one at the shard's end: a target one past the shard counts as owned (its logit
clamped to the last row), the bug class of every vocab-parallel port's ownership test."""

from __future__ import annotations

import torch
import torch.distributed as dist

from verify.adapters.builtin import SumGradOverGroup, flat_loss_adapter
from verify.adapters.interface import Adapter, Call, Capabilities


class _SumOverGroup(torch.autograd.Function):
    """The group's sum forward; the identity backward (every rank's loss is the same)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _token_losses(call: Call, end_owned: bool) -> torch.Tensor:
    hidden, group, rows = call.hidden, call.tp_group, call.weight.shape[0]
    if group is not None and call.reduce_grad_hidden:
        hidden = SumGradOverGroup.apply(hidden, group)
    logits = (hidden @ call.weight.T).float()
    row_max = logits.max(-1).values.detach()
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    sumexp = (logits - row_max[:, None]).exp().sum(-1)
    local = call.targets - call.first_id
    owned = (local >= 0) & ((local <= rows) if end_owned else (local < rows))
    picked = logits.gather(1, local.clamp(0, rows - 1)[:, None])[:, 0]
    picked = torch.where(owned, picked, 0.0)
    if group is not None:
        sumexp, picked = _SumOverGroup.apply(sumexp, group), _SumOverGroup.apply(picked, group)
    valid = call.targets != call.ignore_index
    return torch.where(valid, row_max + sumexp.log() - picked, 0.0)


def _adapter(name: str, end_owned: bool) -> Adapter:
    def loss(call: Call, reduction: str) -> torch.Tensor:
        losses = _token_losses(call, end_owned)
        if reduction == "none":
            return losses
        total = losses.sum()
        return total if reduction == "sum" else total / (call.targets != call.ignore_index).sum()

    caps = Capabilities(tensor_parallel=True, dtype_pairs=(("fp32", "fp32"),))
    return flat_loss_adapter(name, loss, capabilities=caps)


def vocab_parallel() -> Adapter:
    return _adapter("vocab_parallel", end_owned=False)


def shard_end_owned() -> Adapter:
    return _adapter("shard_end_owned", end_owned=True)
