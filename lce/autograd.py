"""The forward and backward of each loss path on plain tensors: stages, TP merge, masking, grad
casts, reductions. lce's custom ops (`lce.ops`) run them; nothing here records autograd history
except `grads_with_graph`, the double backward.

A route's forward returns its two outputs, then the tensors its backward needs (saved by `lce.ops`);
its backward returns the `Grads` of hidden, weight and bias from the upstream gradients of the
two outputs.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from lce.backends.base import Grads, TokenUpstream, Wanted, accumulation_dtype
from lce.call import Call
from lce.loss_pass import loss_pass
from lce.loss_terms import loss_upstream, token_loss
from lce.plan import Plan
from lce.tp import GlobalStats, merge_stats, reduce_grad_hidden
from lce.validation import check_target_ids

# Kernel-side id of an ignored token: owned by no shard, so it adds nothing anywhere.
IGNORED = -1


def kernel_ids(targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ignored, ids)``: int64 ids with ignored rows replaced by `IGNORED`."""
    ignored = targets == ignore_index
    return ignored, torch.where(ignored, IGNORED, targets.long())


def token_shares(
    ignored: torch.Tensor, reduction: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's share of the reduced loss in ``dtype`` (0 where ignored, else 1, or
    ``1 / count`` for ``mean``) and ``count``, the tokens not ignored (int64, 0-dim)."""
    valid = ~ignored
    count = valid.sum()
    scale = valid.to(dtype)
    if reduction == "mean":
        scale = scale / count.clamp_min(1)
    return scale, count


def token_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    plan: Plan,
    keep_logits: bool = False,
) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """The four token statistics (`TokenUpstream`'s order), fp32 ``[T]`` each, of the logits
    ``plan.options.logit`` forms from ``hidden [T, H] @ weight.T + bias``: ``logprob`` of the
    target, ``entropy``, ``lse = logsumexp(z)`` and ``smooth = mean_j(-log p_j)`` (meaningful with
    label smoothing only; the mean is over the whole vocabulary); exactly 0 on ignored rows.

    Also what `token_grads` saves: the kernel ids (`kernel_ids`), the `GlobalStats` stacked
    ``[8, T]`` and, with ``keep_logits``, the raw dots ``[T, V_local]`` in weight's dtype the
    statistics came from (`lce.call.keeps_logits`).
    """
    ignore_index, shard, logit = plan.options.ignore_index, plan.shard, plan.options.logit
    ignored, kernel_targets = kernel_ids(targets, ignore_index)
    kept = None
    if keep_logits:
        kept = weight.new_empty((hidden.shape[0], weight.shape[0]))
    stats = plan.stages.forward_stats(
        hidden.to(weight.dtype), weight, bias, kernel_targets, shard.vocab_start, logit, kept
    )
    merged = merge_stats(stats, shard.owns(kernel_targets), shard, logit)
    zero = torch.zeros_like(merged.max)
    outputs = (merged.logprob, merged.entropy, merged.lse, merged.smooth)
    saved = [kernel_targets, torch.stack([getattr(merged, f.name) for f in fields(GlobalStats)])]
    check_target_ids(targets, merged.owners, ignore_index)  # last: a host check syncs
    outputs = tuple(torch.where(ignored, zero, output) for output in outputs)
    return outputs, saved if kept is None else [*saved, kept]


def token_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    saved: list[torch.Tensor],
    upstream: TokenUpstream,
    plan: Plan,
    wanted: Wanted,
) -> Grads:
    """The gradients of ``sum_t upstream . statistics`` (`token_statistics`, whose ``saved``
    these are) for ``hidden`` of any shape ``[..., H]``: grad_hidden in hidden's dtype and shape
    (summed over the TP group unless ``reduce_grad_hidden`` is False), grad_weight and grad_bias
    in weight's (on their rank)."""
    kernel_targets, stacked, *kept = saved
    merged = GlobalStats(*stacked.unbind(0))
    shard, logit = plan.shard, plan.options.logit
    active = kernel_targets != IGNORED
    zero = torch.zeros_like(merged.max)
    upstream = TokenUpstream(*(torch.where(active, g.reshape(-1), zero) for g in upstream))
    rows = merged.backward_rows(upstream)
    rows = replace(rows, target_grad=torch.where(active, rows.target_grad, zero))
    # The TP sum of grad_hidden runs in fp32, rounded after it; without one the stage rounds
    # its own fp32 sum (the Triton stage then needs no fp32 [T, H] buffer beside the result).
    tp_sum = plan.options.reduce_grad_hidden and shard.group is not None
    grads = plan.stages.backward_grads(
        hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype), weight, bias, kernel_targets,
        shard.vocab_start, logit, rows, wanted, None if tp_sum else hidden.dtype, *kept,
        kept_writable=bool(kept) and last_backward(),
    )  # fmt: skip
    if grads.hidden is not None and tp_sum:
        reduce_grad_hidden(grads.hidden, shard.group)
    return cast_grads(grads, hidden, weight)


def last_backward() -> bool:
    """Whether the running backward is the last to read its saved tensors: the autograd engine
    frees them after it (no ``retain_graph``), so kept logits may take the d_logits in place.
    AOTAutograd asks the engine the same question to let a compiled backward reuse its saved
    tensors' memory. False outside an engine's backward (a direct call of a backward op)."""
    return not torch._C._autograd._get_current_graph_task_keep_graph()


def cast_grads(grads: Grads, hidden: torch.Tensor, weight: torch.Tensor) -> Grads:
    """The gradients in their inputs' dtypes (grad_hidden in hidden's, the others in weight's),
    grad_hidden shaped like hidden."""
    cast = [
        None if grad is None else grad.to(dtype)
        for grad, dtype in zip(grads, _grad_dtypes(hidden, weight), strict=True)
    ]
    return _shaped_like_hidden(cast, hidden)


def _grad_dtypes(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.dtype, ...]:
    """The dtypes of the gradients of hidden, weight and bias (the bias's is weight's)."""
    return hidden.dtype, weight.dtype, weight.dtype


def _shaped_like_hidden(grads: list[torch.Tensor | None], hidden: torch.Tensor) -> Grads:
    """``grads`` (of hidden, weight, bias) with grad_hidden shaped like hidden."""
    if grads[0] is not None:
        grads[0] = grads[0].view(hidden.shape)
    return Grads(*grads)


def tokens_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    plan: Plan,
    call: Call,
) -> list[torch.Tensor]:
    """`lce.token_logprobs`: logprobs and entropy shaped like ``targets``, then what
    `token_statistics` saves."""
    stats, saved = token_statistics(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1), plan,
        call.keep_logits,
    )  # fmt: skip
    return [stats[0].view(targets.shape), stats[1].view(targets.shape), *saved]


def tokens_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    saved: list[torch.Tensor],
    upstream: list[torch.Tensor],
    plan: Plan,
    call: Call,
) -> Grads:
    zero = upstream[0].new_zeros(())
    stats_upstream = TokenUpstream(upstream[0], upstream[1], zero, zero)
    return token_grads(hidden, weight, bias, saved, stats_upstream, plan, call.wanted)


def loss_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    plan: Plan,
    call: Call,
) -> list[torch.Tensor]:
    """The default (4-GEMM) loss: `token_loss` of the token statistics and its z term, reduced;
    then what `token_statistics` saves."""
    (logprob, _, lse, smooth), saved = token_statistics(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1), plan,
        call.keep_logits,
    )  # fmt: skip
    loss, z_term = token_loss(logprob, lse, smooth, plan.options.logit)
    if z_term is None:
        z_term = torch.zeros_like(loss)
    if call.reduction == "none":
        return [loss.view(targets.shape), z_term.view(targets.shape), *saved]
    totals = [loss.sum(), z_term.sum()]
    if call.reduction == "mean":  # the caller's targets count, not the kernel's ids
        count = (targets != plan.options.ignore_index).sum()
        totals = [total / count for total in totals]
    return [*totals, *saved]


def loss_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    saved: list[torch.Tensor],
    upstream: list[torch.Tensor],
    plan: Plan,
    call: Call,
) -> Grads:
    """`loss_forward`'s gradients: each token's loss upstream (``mean``'s over the count), through
    `loss_upstream` to the token statistics."""
    kernel_targets, stats = saved[:2]
    grad_loss = upstream[0].reshape(-1)
    if call.reduction == "mean":
        grad_loss = grad_loss / (targets != plan.options.ignore_index).sum()
    grad_loss = grad_loss.expand(kernel_targets.shape)
    lse = GlobalStats(*stats.unbind(0)).lse
    stats_upstream = loss_upstream(grad_loss.to(lse.dtype), lse, plan.options.logit)
    return token_grads(hidden, weight, bias, saved, stats_upstream, plan, call.wanted)


def fast_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    plan: Plan,
    call: Call,
) -> list[torch.Tensor]:
    """The ``fast`` scalar loss (``sum`` or ``mean``) and its z term, gradients computed during
    the forward pass: each logits chunk once (3 GEMMs instead of 4), grad_weight accumulated
    across token chunks in an fp32 ``[V_local, H]`` buffer of its own; the wanted fp32 gradients
    follow the two outputs (backward only scales them by the loss's upstream)."""
    ignore_index, shard = plan.options.ignore_index, plan.shard
    ignored, ids = kernel_ids(targets.reshape(-1), ignore_index)
    grad_loss, valid_count = token_shares(ignored, call.reduction, accumulation_dtype(weight.dtype))
    result = loss_pass(
        plan.stages, hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype), weight, bias, ids,
        shard, plan.options.logit, grad_loss, call.wanted,
    )  # fmt: skip
    check_target_ids(targets.reshape(-1), result.owners, ignore_index)
    grads = result.grads
    if grads.hidden is not None and plan.options.reduce_grad_hidden:
        reduce_grad_hidden(grads.hidden, shard.group)
    zero = torch.zeros_like(result.losses)
    totals = [torch.where(ignored, zero, t).sum() for t in (result.losses, result.z_terms)]
    if call.reduction == "mean":
        totals = [total / valid_count for total in totals]
    return [*totals, *(grad for grad in grads if grad is not None)]


def fast_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    saved: list[torch.Tensor],
    upstream: list[torch.Tensor],
    plan: Plan,
    call: Call,
) -> Grads:
    saved = list(saved)
    grads = []
    for wanted, dtype in zip(call.wanted, _grad_dtypes(hidden, weight), strict=True):
        grads.append(scaled_copy(saved.pop(0), upstream[0], dtype) if wanted else None)
    return _shaped_like_hidden(grads, hidden)


def grads_with_graph(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    upstream: list[torch.Tensor],
    plan: Plan,
    call: Call,
    wanted: Wanted,
) -> Grads:
    """The gradients as differentiable torch ops, for a backward with ``create_graph``: the
    backend's `stats_with_graph` (torch backend, no TP) through the route's own loss, so the
    second order sees every term (the z-loss's ``lse`` in its upstream too)."""
    stages, shard = plan.stages, plan.shard
    if call.route not in ("tokens", "loss"):
        raise double_backward_error(
            f"linear_cross_entropy's {ROUTE_NAMES[call.route]} path (its gradients are computed "
            "in the forward)"
        )
    stats_with_graph = getattr(stages, "stats_with_graph", None)
    if stats_with_graph is None:
        raise double_backward_error(f"the {type(stages).__name__} backend")
    if shard.group is not None:
        raise double_backward_error("vocab-parallel TP (the softmax sums are collectives)")
    ignored, ids = kernel_ids(targets.reshape(-1), plan.options.ignore_index)
    stats = stats_with_graph(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, ids, shard.vocab_start,
        plan.options.logit,
    )  # fmt: skip
    stats = [torch.where(ignored, 0.0, stat) for stat in stats]
    if call.route == "tokens":
        outputs = stats[:2]
    else:
        loss, _ = token_loss(stats[0], stats[2], stats[3], plan.options.logit)
        count = (~ignored).sum()
        outputs = [loss if call.reduction == "none" else loss.sum()]
        outputs = [outputs[0] / count] if call.reduction == "mean" else outputs
    objective = sum(
        (out.reshape(-1) * g.reshape(-1).to(out.dtype)).sum()
        for out, g in zip(outputs, upstream, strict=False)
    )
    leaves = ((hidden, wanted.hidden), (weight, wanted.weight), (bias, wanted.bias))
    inputs = [tensor for tensor, need in leaves if need]
    grads = list(torch.autograd.grad(objective, inputs, create_graph=True, allow_unused=True))
    return Grads(*(grads.pop(0) if need else None for _, need in leaves))


ROUTE_NAMES = {"fast": "fast=True", "into": "grad_weight_into"}


def double_backward_error(unsupported: str) -> RuntimeError:
    """Refuse a double backward rather than return wrong (zero) second-order terms."""
    return RuntimeError(
        f"double backward (a backward with create_graph=True, e.g. a gradient penalty) is not "
        f"supported by {unsupported}; it is by backend='torch' without TP on the per-token "
        "outputs: token_logprobs, or linear_cross_entropy(..., reduction='none') reduced by you"
    )


def scaled_copy(grad: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(grad * factor).to(dtype)`` in one pass: the product formed in ``grad``'s precision and
    rounded once as it is written: 6 bytes an element moved for an fp32 grad and a bf16 result,
    where a product then a cast (block by block, to bound its fp32 temporary) moved 14, 7.4 GB
    against 3.2 GB for grad_weight at llama3-8k."""
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    return torch.mul(grad, factor, out=out)
