"""Public entry points: DTensor weights to plain tensors, the arguments checked, the call encoded
for lce's custom ops (`lce.ops`), which do the rest. No math here; `torch.compile` traces these
functions whole (``fullgraph=True``) to one op node per call."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from lce.backends.base import Wanted
from lce.call import Call, encode_call, keeps_logits
from lce.dtensor import local_call
from lce.grad_buffer import check_grad_buffer
from lce.ops import IntoGradBuffer  # importing lce.ops registers torch.ops.lce
from lce.options import LCEOptions, LogitOptions, require_at_least
from lce.tp import agree_on_call, usable_group
from lce.validation import check_flag, check_inputs, check_reduction


class TokenOutputs(NamedTuple):
    """Per-token fp32 outputs, shaped like ``targets``; exactly 0 where the target is ignored."""

    logprobs: torch.Tensor
    entropy: torch.Tensor


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    reduce_grad_hidden: bool = True,
    backend: str = "auto",
    chunk_size: int | None = None,
    keep_logits_bytes: int = 0,
) -> TokenOutputs:
    """Per-token log-prob of the target and entropy, never materializing ``[T, V]`` logits.

    ``z = cap * tanh(s * (hidden @ weight.T + bias) / cap) / T`` (``s = logit_scale``,
    ``cap = softcap``, ``T = temperature``; without a cap ``z = s * (hidden @ weight.T + bias) /
    T``); ``logprobs = z_y - logsumexp(z)``; ``entropy = logsumexp(z) - sum_j softmax(z)_j z_j``.
    Both are differentiable w.r.t. ``hidden``, ``weight`` and ``bias`` with any upstream gradients.

    Args:
        hidden: ``[T, H]`` or ``[B, T, H]``; cast to ``weight``'s dtype for the matmul like a linear
            layer; its gradient comes back in its own dtype.
        weight: this rank's LM-head rows ``[V_local, H]`` (the whole ``[V, H]`` without TP).
        targets: global token ids shaped like ``hidden`` without its last dim. Ids outside
            ``[0, V)`` that are not ``ignore_index`` raise ``ValueError`` (on CUDA with
            ``LCE_HOST_CHECKS=1``; by default there a device-side assert fails the stream, with no
            host sync: see `lce.validation.check_target_ids`).
        bias: this rank's LM-head bias ``[V_local]`` (sharded like weight's rows), weight's dtype
            and device; its gradient stays on the rank.
        logit_scale, softcap: see `lce.LogitOptions` (a float > 0; ``softcap`` None: no cap).
        tp_group: vocab-parallel group; ``None`` (or a group of one) means no TP.
        vocab_start: first global id of this rank's rows; default ``tp_rank * V_local``.
        reduce_grad_hidden: sum grad_hidden over the TP group (fp32) in backward; False leaves it
            partial for a caller that reduce-scatters (sequence parallel).
        backend: ``"auto"`` (Triton on CUDA if installed, else torch), ``"torch"`` or ``"triton"``.
        chunk_size: tokens per chunk (default: torch ~64 MiB of fp32 logits per chunk, Triton all
            tokens at once); the Triton kernels then run per block, bounding their workspace.
        keep_logits_bytes: memory the caller lets the forward keep for the backward (0: none).
            Where this rank's ``[T, V_local]`` logits in weight's dtype fit (``T * V_local *
            itemsize <= keep_logits_bytes``) and a gradient is wanted, the forward keeps them
            and the backward does not recompute them: 3 GEMMs instead of 4, at that much more
            memory until backward, which writes its d_logits over them (Triton). A backward
            with ``retain_graph=True`` leaves them for the next one and takes a d_logits buffer
            of their size (of one ``chunk_size`` block's with it). The softmax then sees the
            logits rounded to weight's dtype, as the stock path's and the torch backend's always
            do (the Triton backend otherwise takes fp32 dots).
        Under TP every rank passes the same tokens, the same options and either all or none pass
        ``vocab_start``; ranks that disagree, or any rank whose arguments are rejected, make
        every rank raise before any per-token collective.
        A DTensor ``weight`` (see `lce.dtensor`): Shard(0) on a 1-D mesh runs vocab-parallel on
        the mesh's group, Replicate runs locally; its gradient is a DTensor of the same placement.
    """
    weight, bias, tp_group, vocab_start, _ = local_call(
        hidden, weight, bias, targets, tp_group, vocab_start
    )
    logit = {"temperature": temperature, "logit_scale": logit_scale, "softcap": softcap}
    options = _checked_options(
        hidden, weight, bias, targets, logit,
        dict(
            ignore_index=ignore_index, tp_group=tp_group, vocab_start=vocab_start,
            reduce_grad_hidden=reduce_grad_hidden, backend=backend, chunk_size=chunk_size,
        ),
        keep_logits_bytes=keep_logits_bytes,
    )  # fmt: skip
    wanted = _wanted(hidden, weight, bias)
    keep = _keeps("tokens", wanted, targets, weight, keep_logits_bytes)
    call = Call("tokens", options, wanted=wanted, keep_logits=keep)
    outputs = torch.ops.lce.fused(hidden, weight, bias, targets, encode_call(call))
    return TokenOutputs(outputs[0], outputs[1])


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    return_z_loss: bool = False,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    reduce_grad_hidden: bool = True,
    backend: str = "auto",
    chunk_size: int | None = None,
    keep_logits_bytes: int = 0,
    fast: bool = False,
    grad_weight_into: torch.Tensor | None = None,
    assumed_loss_grad: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the logits of `token_logprobs` against ``targets``, fp32, per token
    ``(1 - eps) (lse - z_y) + eps mean_j(lse - z_j) + c lse^2`` (`lce.LogitOptions`).

    ``reduction``: ``"none"`` (per token, 0 where ignored), ``"sum"``, or ``"mean"`` over
    non-ignored tokens (NaN if all are ignored, as in PyTorch, with exactly zero gradients).
    By default the gradients take 4 GEMMs (logits recomputed in backward) and little memory.

    Args:
        z_loss: ``c >= 0``; the term is added only when ``c > 0``.
        label_smoothing: ``eps`` in [0, 1], PyTorch's definition (the mean over the whole
            vocabulary, every TP shard's).
        return_z_loss: return ``(loss, z_loss)``: the z term alone, reduced like the loss (already
            inside it), detached (for logging).
        fast: ``"sum"``/``"mean"`` in 3 GEMMs: gradients computed in the forward pass, grad_weight
            accumulated across token chunks in an fp32 ``[V_local, H]`` buffer (more memory).
            No effect for ``"none"``: per-token upstream gradients need the 4-GEMM path.
        grad_weight_into: an fp32 (fp64 for fp64 weights) ``[V_local, H]`` buffer, e.g.
            Megatron's ``weight.main_grad``: 3 GEMMs, the weight gradient is added to it (one
            fp32 accumulation, no buffer of lce's own) and ``weight.grad`` is left alone (see
            `lce.grad_buffer.into_forward`); the bias gets an ordinary gradient.
        assumed_loss_grad: with ``grad_weight_into``, the upstream gradient the caller will put
            on the loss (on each token's loss for ``"none"``), which the forward assumes; any
            other stays exact but recomputes the logits of the rows where it differs (for
            ``"none"``; on CUDA a scalar loss's other upstream, or any under CUDA-graph capture,
            fails a device-side assert unless ``LCE_HOST_CHECKS=1``: see `lce.grad_buffer`).
    Other arguments as in `token_logprobs` (``keep_logits_bytes``: the default path only, the
    others keep none; with a DTensor weight ``grad_weight_into`` is a DTensor of its layout).
    """
    weight, bias, tp_group, vocab_start, grad_weight_into = local_call(
        hidden, weight, bias, targets, tp_group, vocab_start, grad_weight_into
    )
    logit = dict(
        temperature=temperature, logit_scale=logit_scale, softcap=softcap, z_loss=z_loss,
        label_smoothing=label_smoothing,
    )  # fmt: skip
    options = _checked_options(
        hidden, weight, bias, targets, logit,
        dict(
            ignore_index=ignore_index, tp_group=tp_group, vocab_start=vocab_start,
            reduce_grad_hidden=reduce_grad_hidden, backend=backend, chunk_size=chunk_size,
        ),
        reduction, return_z_loss, keep_logits_bytes,
    )  # fmt: skip
    wanted = _wanted(hidden, weight, bias)
    route = _loss_route(wanted, reduction, fast, grad_weight_into is not None)
    keep = _keeps(route, wanted, targets, weight, keep_logits_bytes)
    call = Call(route, options, reduction, wanted, assumed_loss_grad, keep)
    text = encode_call(call)
    if route == "into":
        check_grad_buffer(grad_weight_into, weight, assumed_loss_grad)
        outputs = IntoGradBuffer.apply(hidden, weight, bias, targets, grad_weight_into, text, call)
    else:
        outputs = torch.ops.lce.fused(hidden, weight, bias, targets, text)
    return (outputs[0], outputs[1]) if return_z_loss else outputs[0]


def _loss_route(wanted: Wanted, reduction: str, fast: bool, into: bool) -> str:
    """`lce.call.ROUTES`' loss route: the 3-GEMM ones only where a gradient is wanted (and for
    ``fast``, a reduced loss)."""
    if into and any(wanted):
        return "into"
    if fast and reduction != "none" and any(wanted):
        return "fast"
    return "loss"


def _keeps(
    route: str, wanted: Wanted, targets: torch.Tensor, weight: torch.Tensor, budget: int
) -> bool:
    """`lce.call.keeps_logits` for this rank's logits in weight's dtype."""
    return keeps_logits(
        route, wanted, targets.numel(), weight.shape[0], weight.element_size(), budget
    )


def _wanted(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Wanted:
    """The gradients this call's backward computes (none outside grad mode)."""
    grad_mode = torch.is_grad_enabled()
    return Wanted(
        *(grad_mode and leaf is not None and leaf.requires_grad for leaf in (hidden, weight, bias))
    )


def _checked_options(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    logit: dict[str, object],
    settings: dict[str, object],
    reduction: str = "none",
    return_z_loss: bool = False,
    keep_logits_bytes: int = 0,
) -> LCEOptions:
    """The call's options, its arguments checked: ``logit`` holds the `LogitOptions` fields,
    ``settings`` the other `LCEOptions` fields. Every rejected argument raises on every rank of
    the TP group alike (`agree_on_call`; the ranks whose arguments pass meet it in the op)."""
    group = usable_group(settings["tp_group"])
    try:
        options = LCEOptions(logit=LogitOptions(**logit), **settings)
        check_reduction(reduction)
        check_flag("return_z_loss", return_z_loss)
        require_at_least("keep_logits_bytes", keep_logits_bytes, 0, "a memory budget, 0: none")
        check_inputs(hidden, weight, targets, bias)
    except (TypeError, ValueError) as error:
        if group is not None:
            agree_on_call(group, None, error)  # the other ranks raise too, then this one
        raise
    return options
