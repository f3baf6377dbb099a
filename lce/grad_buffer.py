"""The 3-GEMM loss whose weight gradient is added to a caller's fp32 buffer (Megatron's main_grad).

With ``gradient_accumulation_fusion`` Megatron keeps an fp32 ``weight.main_grad`` and its linear
layers add the weight gradient straight into it. The 3-GEMM loss computes its gradients in the
forward pass, so it adds there, one fp32 accumulation and no ``[V_local, H]`` buffer of its own.
The forward assumes an upstream gradient; backward settles the difference exactly (see
`LossIntoGradBuffer`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from lce.autograd import Plan, double_backward_error, kernel_ids
from lce.backends import StageBackend
from lce.backends.base import accumulation_dtype
from lce.loss_pass import loss_pass
from lce.options import LogitOptions
from lce.tp import VocabShard, reduce_grad_hidden
from lce.validation import raise_on_bad_targets


def check_grad_buffer(buffer: torch.Tensor, weight: torch.Tensor, assumed_upstream: float) -> None:
    """Raise unless ``buffer`` can receive ``weight``'s gradient in its accumulation dtype."""
    acc = accumulation_dtype(weight.dtype)
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != acc:
        got = buffer.dtype if isinstance(buffer, torch.Tensor) else type(buffer).__name__
        raise ValueError(
            f"grad_weight_into must be a {acc} tensor (weight's fp32 accumulation buffer, e.g. "
            f"Megatron's weight.main_grad), got {got}"
        )
    if buffer.shape != weight.shape or buffer.device != weight.device:
        raise ValueError(
            f"grad_weight_into must have weight's shape {tuple(weight.shape)} on {weight.device}, "
            f"got {tuple(buffer.shape)} on {buffer.device}"
        )
    if not (math.isfinite(assumed_upstream) and assumed_upstream != 0):
        raise ValueError(f"assumed_upstream must be finite and non-zero, got {assumed_upstream}")


class LossIntoGradBuffer(torch.autograd.Function):
    """Per-token ``row_scale * loss`` (fp32 ``[T]``), the weight gradient added to ``buffer``.

    The forward computes the gradients assuming each output's upstream gradient is
    ``assumed_upstream`` (3 GEMMs), adds the weight part to ``buffer`` and keeps grad_hidden
    (fp32 ``[T, H]``). Backward scales grad_hidden's rows by the actual upstream and recomputes
    the rows whose upstream differs from the assumption (`_settle`): ``buffer`` ends at its old
    content plus the true gradient either way, the assumption only decides the cost.
    ``row_scale`` is 0 on ignored rows. Every TP rank must get the same upstream gradients (the
    per-token loss is replicated, as in megatron-core).

    The weight's own gradient is what megatron-core's linear layers return under
    gradient_accumulation_fusion: a dummy of weight's shape (zeros if ``weight.zero_out_wgrad``)
    with ``weight.grad_added_to_main_grad = True`` where the weight has that flag (Megatron's
    DDP), else None (``weight.grad`` untouched).
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        plan: Plan,
        buffer: torch.Tensor,
        row_scale: torch.Tensor,
        assumed_upstream: float,
    ) -> torch.Tensor:
        ignore_index, logit = plan.options.ignore_index, plan.options.logit
        shard, stages = plan.shard, plan.stages
        _, ids = kernel_ids(targets, ignore_index)
        _raise_before_accumulating(targets, ids, shard, ignore_index)
        compute_hidden = hidden.to(weight.dtype)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_logprob = row_scale * -assumed_upstream  # the loss is -logprob
        logprobs, _, grad_hidden, _ = loss_pass(
            stages, compute_hidden, weight, ids, shard, logit, grad_logprob, need_hidden,
            need_weight, buffer if need_weight else None,
        )  # fmt: skip
        if grad_hidden is not None and plan.options.reduce_grad_hidden:
            reduce_grad_hidden(grad_hidden, shard.group)
        ctx.save_for_backward(grad_hidden, compute_hidden, weight, ids, row_scale)
        ctx.buffer = buffer  # not saved: megatron's layers keep main_grad out of version checks
        ctx.flagged_weight = weight  # the object carrying DDP's flags (saved tensors may not)
        ctx.settings = (hidden.dtype, logit, shard, stages, assumed_upstream)
        return -logprobs * row_scale

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # the saved gradients hold no graph: refuse, never zeros
            raise double_backward_error(
                "linear_cross_entropy's grad_weight_into path (its gradients are computed in the "
                "forward)"
            )
        grad_hidden, compute_hidden, weight, ids, row_scale = ctx.saved_tensors
        hidden_dtype, logit, shard, stages, assumed = ctx.settings
        upstream = torch.where(row_scale != 0, grad_out, torch.zeros_like(grad_out))
        if grad_hidden is not None:
            factor = (upstream / assumed).to(grad_hidden.dtype)
            grad_hidden = (grad_hidden * factor[:, None]).to(hidden_dtype)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            rows = (
                compute_hidden, weight, ids, shard, logit, stages, ctx.buffer, row_scale,
            )  # fmt: skip
            _settle(*rows, assumed, upstream)
            grad_weight = megatron_weight_grad(ctx.flagged_weight)
        return grad_hidden, grad_weight, None, None, None, None, None


def _raise_before_accumulating(
    targets: torch.Tensor, ids: torch.Tensor, shard: VocabShard, ignore_index: int
) -> None:
    """Bad target ids raise before the buffer is touched (one small SUM over the TP group)."""
    owners = shard.owns(ids).to(torch.float32)
    if shard.group is not None:
        dist.all_reduce(owners, op=dist.ReduceOp.SUM, group=shard.group)
    raise_on_bad_targets(targets, owners, ignore_index)


def _settle(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    shard: VocabShard,
    logit: LogitOptions,
    stages: StageBackend,
    buffer: torch.Tensor,
    row_scale: torch.Tensor,
    assumed: float,
    upstream: torch.Tensor,
) -> None:
    """On the rows whose upstream differs from the assumed one (one host sync to find them; none
    when the assumption held): take the forward's weight gradient back out of ``buffer`` and add
    the true one. Undoing and redoing, rather than adding the difference, keeps the single
    rounding of d_logits to weight's dtype: the undo rounds exactly as the forward did, while a
    difference (-1.37 for an upstream of -0.37) would scale the forward's rounding error by
    (1 + 1.37) / 0.37."""
    wrong = (upstream != assumed) & (row_scale != 0)
    rows = torch.nonzero(wrong).squeeze(1)
    if rows.numel() == 0:
        return
    scale = row_scale[rows]
    for rows_used, grad_logprob in (
        (rows, scale * assumed),  # the forward's -assumed * row_scale, negated
        (rows, -upstream[rows] * scale),
    ):
        loss_pass(
            stages, hidden[rows_used], weight, ids[rows_used], shard, logit, grad_logprob,
            False, True, buffer,
        )  # fmt: skip


def megatron_weight_grad(weight: torch.Tensor) -> torch.Tensor | None:
    """What megatron-core's linear layers return for a weight whose gradient went to main_grad.

    Megatron's DDP marks its parameters with ``grad_added_to_main_grad``; for them a dummy
    gradient keeps its backward hooks on the main thread, and the flag tells the hook not to add
    it (unless ``zero_out_wgrad``: tied embeddings, where the dummy is zeros and the embedding's
    own gradient is added). Without the flag: None.
    """
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.shape, dtype=weight.dtype, device=weight.device)


def loss_into_grad_buffer(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    plan: Plan,
    buffer: torch.Tensor,
    reduction: str,
    assumed_upstream: float,
) -> torch.Tensor:
    """The loss with ``reduction`` (shaped like `lce.linear_cross_entropy`'s), its weight gradient
    added to ``buffer``; ``assumed_upstream``: the gradient the caller will put on the loss (on
    each token's loss for ``"none"``). Inputs already checked by `lce.validation.check_inputs`."""
    check_grad_buffer(buffer, weight, assumed_upstream)
    valid = targets.reshape(-1) != plan.options.ignore_index
    valid_count = valid.sum()
    acc = accumulation_dtype(weight.dtype)
    per_row = 1.0 if reduction != "mean" else 1.0 / valid_count.clamp_min(1).to(acc)
    row_scale = torch.where(valid, per_row, 0.0).to(acc)
    losses = LossIntoGradBuffer.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
        plan, buffer, row_scale, assumed_upstream,
    )  # fmt: skip
    if reduction == "none":
        return losses.view(targets.shape)
    total = losses.sum()
    if reduction == "mean":  # NaN when every token is ignored, as in PyTorch
        total = torch.where(valid_count > 0, total, torch.nan)
    return total
