"""The autograd functions every backend runs through: stages, TP merge, masking, grad casts."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from lce.backends.base import Grads, StageBackend, TokenUpstream, Wanted, accumulation_dtype
from lce.loss_pass import loss_pass
from lce.options import LCEOptions
from lce.tp import GlobalStats, VocabShard, merge_stats, reduce_grad_hidden
from lce.validation import check_target_ids

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


class FusedTokenStats(torch.autograd.Function):
    """The four token statistics (`TokenUpstream`'s order), fp32 ``[T]`` each, of the logits
    ``plan.options.logit`` forms from ``hidden @ weight.T + bias``: ``logprob`` of the target,
    ``entropy``, ``lse = logsumexp(z)`` and ``smooth = mean_j(-log p_j)`` (meaningful with label
    smoothing only; the mean is over the whole vocabulary).

    Ignored rows give exactly 0 in every output and gradient. grad_hidden is returned in hidden's
    dtype (summed over the TP group unless ``reduce_grad_hidden`` is False); grad_weight and
    grad_bias in weight's (grad_bias stays on its rank, like grad_weight).
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        plan: Plan,
    ) -> tuple[torch.Tensor, ...]:
        ignore_index, shard, logit = plan.options.ignore_index, plan.shard, plan.options.logit
        ignored, kernel_targets = kernel_ids(targets, ignore_index)
        stats = plan.stages.forward_stats(
            hidden.to(weight.dtype), weight, bias, kernel_targets, shard.vocab_start, logit
        )
        merged = merge_stats(stats, shard.owns(kernel_targets), shard, logit)
        zero = torch.zeros_like(merged.max)
        outputs = (merged.logprob, merged.entropy, merged.lse, merged.smooth)
        saved_stats = (getattr(merged, f.name) for f in fields(GlobalStats))
        # hidden itself, not its cast: a double backward differentiates through the cast.
        ctx.save_for_backward(hidden, weight, bias, kernel_targets, *saved_stats)
        ctx.plan = plan
        check_target_ids(targets, merged.owners, ignore_index)  # last: a host check syncs
        return tuple(torch.where(ignored, zero, output) for output in outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, kernel_targets, *saved_stats = ctx.saved_tensors
        merged = GlobalStats(*saved_stats)
        plan: Plan = ctx.plan
        shard, logit = plan.shard, plan.options.logit
        wanted = Wanted(*ctx.needs_input_grad[:3])
        active = kernel_targets != IGNORED
        zero = torch.zeros_like(merged.max)
        upstream = TokenUpstream(
            *(zero if g is None else torch.where(active, g, zero) for g in grad_outputs)
        )
        if torch.is_grad_enabled():  # create_graph=True: this backward is differentiated too
            grads_with_graph = getattr(plan.stages, "grads_with_graph", None)
            if grads_with_graph is None:
                raise double_backward_error(f"the {type(plan.stages).__name__} backend")
            if shard.group is not None:
                raise double_backward_error("vocab-parallel TP (the softmax sums are collectives)")
            grads = grads_with_graph(
                hidden, weight, bias, kernel_targets, shard.vocab_start, logit, upstream, wanted
            )
            return (*grads, None, None)
        rows = merged.backward_rows(upstream)
        rows = replace(rows, target_grad=torch.where(active, rows.target_grad, zero))
        # The TP sum of grad_hidden runs in fp32, rounded after it; without one the stage rounds
        # its own fp32 sum (the Triton stage then needs no fp32 [T, H] buffer beside the result).
        tp_sum = plan.options.reduce_grad_hidden and shard.group is not None
        grads = plan.stages.backward_grads(
            hidden.to(weight.dtype), weight, bias, kernel_targets, shard.vocab_start, logit,
            rows, wanted, None if tp_sum else hidden.dtype,
        )  # fmt: skip
        if grads.hidden is not None and tp_sum:
            reduce_grad_hidden(grads.hidden, shard.group)
        return (*cast_grads(grads, hidden, weight), None, None)


def cast_grads(grads: Grads, hidden: torch.Tensor, weight: torch.Tensor) -> Grads:
    """The gradients in their inputs' dtypes: grad_hidden in hidden's, the others in weight's."""
    return Grads(
        *(
            None if grad is None else grad.to(dtype)
            for grad, dtype in zip(grads, (hidden.dtype, weight.dtype, weight.dtype), strict=True)
        )
    )


class FusedScalarLoss(torch.autograd.Function):
    """``sum`` or ``mean`` loss (`lce.loss_terms.token_loss`) and its z term, gradients computed
    during the forward pass.

    The fast mode (``linear_cross_entropy(..., fast=True)``): the upstream gradient of a scalar
    loss is known up to one factor, so each logits chunk is computed once (3 GEMMs instead of 4)
    and grad_weight accumulates across token chunks in an fp32 ``[V_local, H]`` buffer of its own;
    backward only scales the saved fp32 gradients by ``grad_output``. The z term (reduced like
    the loss, already inside it) is for logging: no gradient flows through it. Same contract as
    `FusedTokenStats`.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        plan: Plan,
        reduction: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ignore_index, shard = plan.options.ignore_index, plan.shard
        ignored, ids = kernel_ids(targets, ignore_index)
        valid_count = (~ignored).sum()
        acc = accumulation_dtype(weight.dtype)
        scale = 1.0 if reduction == "sum" else 1.0 / valid_count.clamp_min(1).to(acc)
        grad_loss = torch.where(ignored, 0.0, scale).to(acc)
        wanted = Wanted(*ctx.needs_input_grad[:3])
        result = loss_pass(
            plan.stages, hidden.to(weight.dtype), weight, bias, ids, shard, plan.options.logit,
            grad_loss, wanted,
        )  # fmt: skip
        check_target_ids(targets, result.owners, ignore_index)
        grads = result.grads
        if grads.hidden is not None and plan.options.reduce_grad_hidden:
            reduce_grad_hidden(grads.hidden, shard.group)
        ctx.save_for_backward(*grads)
        ctx.dtypes = (hidden.dtype, weight.dtype, weight.dtype)
        zero = torch.zeros_like(result.losses)
        totals = [torch.where(ignored, zero, t).sum() for t in (result.losses, result.z_terms)]
        if reduction == "mean":
            totals = [total / valid_count for total in totals]
        ctx.mark_non_differentiable(totals[1])
        return totals[0], totals[1]

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _: Any) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # the saved gradients hold no graph: refuse, never zeros
            raise double_backward_error(
                "linear_cross_entropy's fast=True path (its gradients are computed in the forward)"
            )
        scaled = [
            None if grad is None else scaled_copy(grad, grad_loss, dtype)
            for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True)
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
