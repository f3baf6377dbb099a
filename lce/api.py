"""Public entry points: validate, pick the backend, flatten ``[B, T, H]``, reduce. No math here."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from lce.autograd import FusedLogprobEntropy, FusedScalarLoss, Plan
from lce.backends import get_stages, resolve_backend_name
from lce.backends.torch_chunked import default_chunk_size
from lce.grad_buffer import loss_into_grad_buffer
from lce.options import LCEOptions, LogitOptions
from lce.tp import CallShape, agree_on_call, logit_key, resolve_shard, usable_group
from lce.validation import check_inputs, check_reduction


class TokenOutputs(NamedTuple):
    """Per-token fp32 outputs, shaped like ``targets``; exactly 0 where the target is ignored."""

    logprobs: torch.Tensor
    entropy: torch.Tensor


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    reduce_grad_hidden: bool = True,
    backend: str = "auto",
    chunk_size: int | None = None,
) -> TokenOutputs:
    """Per-token log-prob of the target and entropy, never materializing ``[T, V]`` logits.

    ``z = (hidden @ weight.T) / temperature``; ``logprobs = z_y - logsumexp(z)``;
    ``entropy = logsumexp(z) - sum_j softmax(z)_j z_j``. Both are differentiable w.r.t. ``hidden``
    and ``weight`` with any upstream gradients.

    Args:
        hidden: ``[T, H]`` or ``[B, T, H]``; cast to ``weight``'s dtype for the matmul like a linear
            layer; its gradient comes back in its own dtype.
        weight: this rank's LM-head rows ``[V_local, H]`` (the whole ``[V, H]`` without TP).
        targets: global token ids shaped like ``hidden`` without its last dim. Ids outside
            ``[0, V)`` that are not ``ignore_index`` raise ``ValueError``.
        tp_group: vocab-parallel group; ``None`` (or a group of one) means no TP.
        vocab_start: first global id of this rank's rows; default ``tp_rank * V_local``.
        reduce_grad_hidden: sum grad_hidden over the TP group (fp32) in backward; False leaves it
            partial for a caller that reduce-scatters (sequence parallel).
        backend: ``"auto"`` (Triton on CUDA if installed, else torch), ``"torch"`` or ``"triton"``.
        chunk_size: tokens per chunk (default: torch ~64 MiB of fp32 logits per chunk, Triton all
            tokens at once); the Triton kernels then run per block, bounding their workspace.
        Under TP every rank passes the same tokens and either all or none pass ``vocab_start``;
        ranks that disagree all raise the same ``ValueError`` before any per-token collective.
    """
    plan = _plan(
        hidden, weight, targets, "none", {"temperature": temperature},
        ignore_index=ignore_index, tp_group=tp_group, vocab_start=vocab_start,
        reduce_grad_hidden=reduce_grad_hidden, backend=backend, chunk_size=chunk_size,
    )  # fmt: skip
    return _token_outputs(hidden, weight, targets, plan)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    reduce_grad_hidden: bool = True,
    backend: str = "auto",
    chunk_size: int | None = None,
    fast: bool = False,
    grad_weight_into: torch.Tensor | None = None,
    assumed_loss_grad: float = 1.0,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T / temperature`` against ``targets``, fp32.

    ``reduction``: ``"none"`` (per token, 0 where ignored), ``"sum"``, or ``"mean"`` over
    non-ignored tokens (NaN if all are ignored, as in PyTorch, with exactly zero gradients).
    By default the gradients take 4 GEMMs (logits recomputed in backward) and little memory.

    Args:
        fast: ``"sum"``/``"mean"`` in 3 GEMMs: gradients computed in the forward pass, grad_weight
            accumulated across token chunks in an fp32 ``[V_local, H]`` buffer (more memory).
            No effect for ``"none"``: per-token upstream gradients need the 4-GEMM path.
        grad_weight_into: an fp32 (fp64 for fp64 weights) ``[V_local, H]`` buffer, e.g.
            Megatron's ``weight.main_grad``: 3 GEMMs, the weight gradient is added to it (one
            fp32 accumulation, no buffer of lce's own) and ``weight.grad`` is left alone (see
            `lce.grad_buffer.LossIntoGradBuffer` for Megatron's DDP flags).
        assumed_loss_grad: with ``grad_weight_into``, the upstream gradient the caller will put
            on the loss (on each token's loss for ``"none"``), which the forward assumes; any
            other stays exact but recomputes the logits of the rows where it differs.
    Other arguments as in `token_logprobs`.
    """
    plan = _plan(
        hidden, weight, targets, reduction, {"temperature": temperature},
        ignore_index=ignore_index, tp_group=tp_group, vocab_start=vocab_start,
        reduce_grad_hidden=reduce_grad_hidden, backend=backend, chunk_size=chunk_size,
    )  # fmt: skip
    if grad_weight_into is not None and _grads_wanted(hidden, weight):
        return loss_into_grad_buffer(
            hidden, weight, targets, plan, grad_weight_into, reduction, assumed_loss_grad
        )
    if fast and reduction != "none" and _grads_wanted(hidden, weight):
        return FusedScalarLoss.apply(
            hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), plan, reduction
        )
    logprobs = _token_outputs(hidden, weight, targets, plan).logprobs
    if reduction == "none":
        return -logprobs
    total = -logprobs.sum()
    if reduction == "sum":
        return total
    return total / (targets != plan.options.ignore_index).sum()


def _token_outputs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, plan: Plan
) -> TokenOutputs:
    logprobs, entropy = FusedLogprobEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), plan
    )
    return TokenOutputs(logprobs.view(targets.shape), entropy.view(targets.shape))


def _grads_wanted(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)


def _plan(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    reduction: str,
    logit: dict[str, object],
    **settings: object,
) -> Plan:
    """Check the arguments, agree with the TP group's other ranks, pick the stages and shard.

    ``logit`` holds the `LogitOptions` fields, ``settings`` the other `LCEOptions` fields. Every
    rejected argument raises on every rank of the TP group alike (`agree_on_call`).
    """
    group = usable_group(settings["tp_group"])
    try:
        options = LCEOptions(logit=LogitOptions(**logit), **settings)
        check_reduction(reduction)
        check_inputs(hidden, weight, targets)
        backend = resolve_backend_name(options.backend, hidden.device, weight.dtype)
    except (TypeError, ValueError) as error:
        if group is not None:
            agree_on_call(group, None, error)  # the other ranks raise too, then this one
        raise
    chunk_size = options.chunk_size
    if group is not None:
        shape = CallShape(
            targets.numel(), weight.shape[0], options.vocab_start is not None,
            logit_key(options.logit),
        )  # fmt: skip
        largest_shard = agree_on_call(group, shape, None)
        if backend == "torch" and chunk_size is None:
            # The scalar-loss path merges per chunk: every rank must cut the tokens alike.
            chunk_size = default_chunk_size(largest_shard)
    return Plan(
        options=options,
        shard=resolve_shard(group, options.vocab_start, weight.shape[0]),
        stages=get_stages(backend, hidden.device, chunk_size),
    )
