"""The 3-GEMM loss whose weight gradient is added to a caller's fp32 buffer (Megatron's main_grad).

With ``gradient_accumulation_fusion`` Megatron keeps an fp32 ``weight.main_grad`` and its linear
layers add the weight gradient straight into it. The 3-GEMM loss computes its gradients in the
forward pass, so it adds there, one fp32 accumulation and no ``[V_local, H]`` buffer of its own.
The forward assumes an upstream gradient; backward settles the difference exactly (see
`into_forward`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from lce.autograd import kernel_ids, token_shares
from lce.backends.base import Grads, Wanted, accumulation_dtype
from lce.call import Call
from lce.loss_pass import loss_pass
from lce.plan import Plan
from lce.tp import VocabShard, reduce_grad_hidden
from lce.validation import HOST_CHECKS_ENV, check_target_ids, host_checks

# What a failed device-side check of the assumed upstream prints (see `_settle`).
ASSUMED_UPSTREAM_ASSERT = (
    "lce grad_weight_into: the loss's upstream gradient is not assumed_loss_grad; pass the "
    f"gradient you put on the loss as assumed_loss_grad, or set {HOST_CHECKS_ENV}=1 to recompute "
    "exactly (one host sync)"
)


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


def into_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    buffer: torch.Tensor,
    plan: Plan,
    call: Call,
) -> list[torch.Tensor]:
    """The loss and its z term with ``call.reduction`` (shaped like `lce.linear_cross_entropy`'s),
    the weight gradient added to ``buffer`` (checked by `check_grad_buffer`); then the fp32
    grad_hidden and grad_bias (as wanted).

    The forward computes the gradients assuming each token's loss gets the upstream gradient
    ``call.assumed_loss_grad`` (3 GEMMs), adds the weight part to ``buffer`` and keeps grad_hidden
    (fp32 ``[T, H]``) and grad_bias (fp32). `into_backward` scales grad_hidden's rows by the actual
    upstream and recomputes the rows whose upstream differs from the assumption (`_settle`):
    ``buffer`` (and grad_bias) end at the true gradient either way, the assumption only decides
    the cost (where no host sync may find those rows, a device-side assert requires the
    assumption instead). Every TP rank must get the same upstream gradients (the per-token loss is
    replicated, as in megatron-core). The z term (inside the loss already) is for logging: no
    gradient flows through it.
    """
    ignore_index, logit = plan.options.ignore_index, plan.options.logit
    shard, stages, wanted = plan.shard, plan.stages, call.wanted
    flat_targets = targets.reshape(-1)
    ignored, ids = kernel_ids(flat_targets, ignore_index)
    row_scale, valid_count = token_shares(ignored, call.reduction, accumulation_dtype(weight.dtype))
    _check_before_accumulating(flat_targets, ids, shard, ignore_index)
    result = loss_pass(
        stages, hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype), weight, bias, ids, shard,
        logit, row_scale * call.assumed_loss_grad, wanted, buffer if wanted.weight else None,
    )  # fmt: skip
    grad_hidden, grad_bias = result.grads.hidden, result.grads.bias
    if grad_hidden is not None and plan.options.reduce_grad_hidden:
        reduce_grad_hidden(grad_hidden, shard.group)
    losses, z_terms = result.losses * row_scale, result.z_terms * row_scale
    if call.reduction == "none":
        totals = [losses.view(targets.shape), z_terms.view(targets.shape)]
    else:
        totals = [losses.sum(), z_terms.sum()]
    if call.reduction == "mean":  # NaN when every token is ignored, as in PyTorch
        totals = [torch.where(valid_count > 0, total, torch.nan) for total in totals]
    return [*totals, *(grad for grad in (grad_hidden, grad_bias) if grad is not None)]


def into_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    saved: list[torch.Tensor],
    upstream: list[torch.Tensor],
    buffer: torch.Tensor,
    plan: Plan,
    call: Call,
) -> Grads:
    """`into_forward`'s gradients of hidden and bias, ``buffer`` settled to the true weight
    gradient (the weight's own gradient is `megatron_weight_grad`, outside the op)."""
    flat_targets = targets.reshape(-1)
    ignored, ids = kernel_ids(flat_targets, plan.options.ignore_index)
    row_scale, valid_count = token_shares(ignored, call.reduction, accumulation_dtype(weight.dtype))
    grad_out = upstream[0]
    if call.reduction == "mean":  # the NaN of an all-ignored mean passes no gradient
        grad_out = torch.where(valid_count > 0, grad_out, torch.zeros_like(grad_out))
    grad_out = grad_out.reshape(-1).expand(flat_targets.shape)
    wanted, assumed = call.wanted, call.assumed_loss_grad
    grad_hidden = saved[0] if wanted.hidden else None  # `lce.ops.into_slots`
    grad_bias = saved[1] if wanted.bias else None
    grad_upstream = torch.where(row_scale != 0, grad_out, torch.zeros_like(grad_out))
    if grad_hidden is not None:
        factor = (grad_upstream / assumed).to(grad_hidden.dtype)
        grad_hidden = (grad_hidden * factor[:, None]).to(hidden.dtype).view(hidden.shape)
    if grad_bias is not None:
        grad_bias = grad_bias.clone()  # the saved one stays as saved (a second backward)
    if wanted.weight or wanted.bias:
        operands = (
            hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype), weight, bias, ids, plan.shard,
            plan.options.logit, plan.stages,
        )  # fmt: skip
        _settle(
            operands, Wanted(False, wanted.weight, wanted.bias), buffer, grad_bias, row_scale,
            assumed, grad_upstream, call.reduction == "none",
        )  # fmt: skip
    if grad_bias is not None:
        grad_bias = grad_bias.to(weight.dtype)
    return Grads(grad_hidden, None, grad_bias)


def _check_before_accumulating(
    targets: torch.Tensor, ids: torch.Tensor, shard: VocabShard, ignore_index: int
) -> None:
    """Bad target ids raise before the buffer is touched (one small SUM over the TP group)."""
    owners = shard.owns(ids).to(torch.float32)
    if shard.group is not None:
        dist.all_reduce(owners, op=dist.ReduceOp.SUM, group=shard.group)
    check_target_ids(targets, owners, ignore_index)


def _settle(
    operands: tuple[Any, ...],
    wanted: Wanted,
    buffer: torch.Tensor,
    grad_bias: torch.Tensor | None,
    row_scale: torch.Tensor,
    assumed: float,
    upstream: torch.Tensor,
    per_token: bool,
) -> None:
    """On the rows whose upstream differs from the assumed one: take the forward's weight and bias
    gradients back out of ``buffer`` and ``grad_bias`` and add the true ones. ``operands``:
    ``(hidden, weight, bias, ids, shard, logit, stages)`` as the forward's `loss_pass` took them.
    Undoing and redoing, rather than adding the difference, keeps the single rounding of d_logits
    to weight's dtype: the undo rounds exactly as the forward did, while a difference (-1.37 for
    an upstream of -0.37) would scale the forward's rounding error by (1 + 1.37) / 0.37.

    Finding the rows is a host sync on CUDA. It is made for per-token losses (``per_token``:
    their upstream is the caller's, e.g. a loss mask) and with ``LCE_HOST_CHECKS=1``; a scalar
    loss's one upstream (it would recompute every row), ``LCE_HOST_CHECKS=0`` and CUDA-graph
    capture get a device-side assert that the assumption held instead (`host_checks`).
    """
    hidden, weight, bias, ids, shard, logit, stages = operands
    wrong = (upstream != assumed) & (row_scale != 0)
    if not host_checks(wrong.device, default=per_token):
        torch._assert_async(~wrong.any(), ASSUMED_UPSTREAM_ASSERT)
        return
    rows = torch.nonzero(wrong).squeeze(1)
    if rows.numel() == 0:
        return
    scale = row_scale[rows]
    for grad_loss in (-scale * assumed, upstream[rows] * scale):  # undo the forward's, redo
        grads = loss_pass(
            stages, hidden[rows], weight, bias, ids[rows], shard, logit, grad_loss, wanted,
            buffer if wanted.weight else None,
        ).grads  # fmt: skip
        if grad_bias is not None:
            grad_bias += grads.bias


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
