"""The one autograd function every backend runs through: stages, TP merge, masking, grad casts."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from lce.backends.base import BackwardRows, StageBackend, accumulation_dtype
from lce.loss_pass import loss_pass
from lce.options import LCEOptions
from lce.tp import GlobalStats, VocabShard, merge_stats, reduce_grad_hidden
from lce.validation import raise_on_bad_targets

# Kernel-side id of an ignored token: owned by no shard, so it adds nothing anywhere.
IGNORED = -1


@dataclass(frozen=True)
class Plan:
    """One call, resolved: the caller's options, this rank's vocab shard, the backend's stages."""

    options: LCEOptions
    shard: VocabShard
    stages: StageBackend


def kernel_ids(targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ignored, ids)``: int64 ids with ignored rows replaced by `IGNORED`."""
    ignored = targets == ignore_index
    return ignored, torch.where(ignored, IGNORED, targets.long())


class FusedLogprobEntropy(torch.autograd.Function):
    """``(logprobs, entropy)`` fp32 ``[T]`` of the log-softmax of the logits ``plan.options.logit``
    forms from ``hidden @ weight.T``.

    Ignored rows give exactly 0 in both outputs and gradients. grad_hidden is returned in hidden's
    dtype (summed over the TP group unless ``reduce_grad_hidden`` is False); grad_weight in
    weight's.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        plan: Plan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ignore_index, shard = plan.options.ignore_index, plan.shard
        ignored, kernel_targets = kernel_ids(targets, ignore_index)
        logit = plan.options.logit
        stats = plan.stages.forward_stats(
            hidden.to(weight.dtype), weight, kernel_targets, shard.vocab_start, logit
        )
        merged = merge_stats(stats, shard.owns(kernel_targets), shard.group, logit)
        zero = torch.zeros_like(merged.max)
        logprobs = torch.where(ignored, zero, merged.logprob)
        entropy = torch.where(ignored, zero, merged.entropy)
        saved_stats = (getattr(merged, f.name) for f in fields(GlobalStats))
        # hidden itself, not its cast: a double backward differentiates through the cast.
        ctx.save_for_backward(hidden, weight, kernel_targets, *saved_stats)
        ctx.plan = plan
        raise_on_bad_targets(targets, merged.owners, ignore_index)  # last: it syncs with the GPU
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, kernel_targets, *saved_stats = ctx.saved_tensors
        merged = GlobalStats(*saved_stats)
        plan: Plan = ctx.plan
        shard = plan.shard
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        active = kernel_targets != IGNORED
        zero = torch.zeros_like(merged.max)
        grad_logprob = zero if grad_logprob is None else torch.where(active, grad_logprob, zero)
        grad_entropy = zero if grad_entropy is None else torch.where(active, grad_entropy, zero)
        if torch.is_grad_enabled():  # create_graph=True: this backward is differentiated too
            grads_with_graph = getattr(plan.stages, "grads_with_graph", None)
            if grads_with_graph is None:
                raise double_backward_error(f"the {type(plan.stages).__name__} backend")
            if shard.group is not None:
                raise double_backward_error("vocab-parallel TP (the softmax sums are collectives)")
            return (
                *grads_with_graph(
                    hidden, weight, kernel_targets, shard.vocab_start, plan.options.logit,
                    grad_logprob, grad_entropy, need_hidden, need_weight,
                ),
                None,
                None,
            )  # fmt: skip
        rows = BackwardRows(
            merged.max,
            merged.log_sumexp,
            merged.centred_mean,
            grad_logprob,
            grad_entropy,
            torch.where(active, merged.target_grad(grad_logprob, grad_entropy), zero),
        )
        # The TP sum of grad_hidden runs in fp32, rounded after it; without one the stage rounds
        # its own fp32 sum (the Triton stage then needs no fp32 [T, H] buffer beside the result).
        tp_sum = plan.options.reduce_grad_hidden and shard.group is not None
        grad_hidden, grad_weight = plan.stages.backward_grads(
            hidden.to(weight.dtype), weight, kernel_targets, shard.vocab_start,
            plan.options.logit, rows, need_hidden, need_weight,
            None if tp_sum else hidden.dtype,
        )  # fmt: skip
        if grad_hidden is not None:
            if tp_sum:
                reduce_grad_hidden(grad_hidden, shard.group)
            grad_hidden = grad_hidden.to(hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


class FusedScalarLoss(torch.autograd.Function):
    """``sum`` or ``mean`` cross-entropy with its gradients computed during the forward pass.

    The fast mode (``linear_cross_entropy(..., fast=True)``): the upstream gradient of a scalar
    loss is known up to one factor, so each logits chunk is computed once (3 GEMMs instead of 4)
    and grad_weight accumulates across token chunks in an fp32 ``[V_local, H]`` buffer of its own;
    backward only scales the saved fp32 gradients by ``grad_output``. Same contract as
    `FusedLogprobEntropy`.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        plan: Plan,
        reduction: str,
    ) -> torch.Tensor:
        ignore_index, shard = plan.options.ignore_index, plan.shard
        ignored, ids = kernel_ids(targets, ignore_index)
        valid_count = (~ignored).sum()
        acc = accumulation_dtype(weight.dtype)
        scale = 1.0 if reduction == "sum" else 1.0 / valid_count.clamp_min(1).to(acc)
        grad_logprob = torch.where(ignored, 0.0, -scale).to(acc)
        logprobs, owners, grad_hidden, grad_weight = loss_pass(
            plan.stages, hidden.to(weight.dtype), weight, ids, shard, plan.options.logit,
            grad_logprob, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
        )  # fmt: skip
        raise_on_bad_targets(targets, owners, ignore_index)
        if grad_hidden is not None and plan.options.reduce_grad_hidden:
            reduce_grad_hidden(grad_hidden, shard.group)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        total = -torch.where(ignored, 0.0, logprobs).sum()
        return total if reduction == "sum" else total / valid_count

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # the saved gradients hold no graph: refuse, never zeros
            raise double_backward_error(
                "linear_cross_entropy's fast=True path (its gradients are computed in the forward)"
            )
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        scaled = [
            None if grad is None else scaled_copy(grad, grad_loss, dtype)
            for grad, dtype in ((grad_hidden, hidden_dtype), (grad_weight, weight_dtype))
        ]
        return (*scaled, None, None, None)


def double_backward_error(unsupported: str) -> RuntimeError:
    """Refuse a double backward rather than return wrong (zero) second-order terms."""
    return RuntimeError(
        f"double backward (a backward with create_graph=True, e.g. a gradient penalty) is not "
        f"supported by {unsupported}; it is by backend='torch' without TP on the per-token "
        "outputs: token_logprobs, or linear_cross_entropy(..., reduction='none') reduced by you"
    )


# Rows of one block of `scaled_copy`: its fp32 temporary stays near this many bytes.
SCALE_BLOCK_BYTES = 64 << 20


def scaled_copy(grad: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(grad * factor).to(dtype)`` block by block: no second full-size fp32 temporary next to
    the saved fp32 gradient (2 GiB for grad_weight at llama3-8k)."""
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    row_bytes = math.prod(grad.shape[1:]) * grad.element_size()
    step = max(1, SCALE_BLOCK_BYTES // max(1, row_bytes))
    for start in range(0, grad.shape[0], step):
        out[start : start + step] = grad[start : start + step] * factor
    return out
