"""lce's custom ops: every call of `lce.token_logprobs` and `lce.linear_cross_entropy` runs
through them, eagerly and under `torch.compile` alike.

A `torch.library` custom op is opaque to the compiler: Dynamo records one node, Inductor calls
the op as it is (never fusing or reordering lce's numerics into its own kernels) and its body
is lce's eager code, with the host checks, collectives and Triton launches it makes. Each op has
a fake implementation (the outputs' shapes and dtypes from the inputs', symbolic token counts
included) and a registered autograd formula whose backward is another op.

``lce::fused`` runs the routes of `lce.call.ROUTES` whose gradients need no caller buffer;
``lce::fused_into`` the ``grad_weight_into`` route, which adds to (mutates) the caller's buffer
in its forward and backward (its autograd formula is `IntoGradBuffer`: torch.library registers
formulas for functional ops only). Each forward returns its two outputs, then what its
backward needs (op outputs, so the compiler's partitioner keeps them); each backward op returns
the wanted gradients of hidden, weight and bias, in that order. A backward under grad mode (a double
backward, ``create_graph=True``) runs differentiable torch ops instead (`grads_with_graph`),
or refuses.
"""

from __future__ import annotations

from typing import Any

import torch

from lce.autograd import (
    fast_backward,
    fast_forward,
    grads_with_graph,
    loss_backward,
    loss_forward,
    tokens_backward,
    tokens_forward,
)
from lce.backends.base import Wanted, accumulation_dtype
from lce.call import Call, decode_call
from lce.grad_buffer import into_backward, into_forward, megatron_weight_grad
from lce.plan import plan_call
from lce.tp import GlobalStats

FORWARDS = {"tokens": tokens_forward, "loss": loss_forward, "fast": fast_forward}
BACKWARDS = {"tokens": tokens_backward, "loss": loss_backward, "fast": fast_backward}

_INPUTS = "Tensor hidden, Tensor weight, Tensor? bias, Tensor targets"
_SAVED = "Tensor[] saved, Tensor[] upstream"


@torch.library.custom_op("lce::fused", mutates_args=(), schema=f"({_INPUTS}, str call) -> Tensor[]")
def fused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    call: str,
) -> list[torch.Tensor]:
    """The forward of route ``call.route`` (see the module's docstring)."""
    decoded = decode_call(call)
    plan = plan_call(decoded, hidden, weight, targets, agree=True)
    return FORWARDS[decoded.route](hidden, weight, bias, targets, plan, decoded)


@torch.library.custom_op(
    "lce::fused_backward", mutates_args=(), schema=f"({_INPUTS}, {_SAVED}, str call) -> Tensor[]"
)
def fused_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    saved: list[torch.Tensor],
    upstream: list[torch.Tensor],
    call: str,
) -> list[torch.Tensor]:
    """The wanted gradients of hidden, weight and bias, from `fused`'s saved outputs and the
    upstream gradients of its two outputs."""
    decoded = decode_call(call)
    plan = plan_call(decoded, hidden, weight, targets, agree=False)
    grads = BACKWARDS[decoded.route](hidden, weight, bias, targets, saved, upstream, plan, decoded)
    return [grad for grad in grads if grad is not None]


@torch.library.custom_op(
    "lce::fused_into",
    mutates_args=("grad_weight_into",),
    schema=f"({_INPUTS}, Tensor(a!) grad_weight_into, str call) -> ({', '.join(['Tensor'] * 4)})",
)
def fused_into(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    grad_weight_into: torch.Tensor,
    call: str,
) -> tuple[torch.Tensor, ...]:
    """The ``into`` route's forward (`lce.grad_buffer.into_forward`): the loss, its z term, then
    grad_hidden and grad_bias in `into_slots`."""
    decoded = decode_call(call)
    plan = plan_call(decoded, hidden, weight, targets, agree=True)
    outputs = into_forward(hidden, weight, bias, targets, grad_weight_into, plan, decoded)
    return (*outputs[:2], *into_slots(outputs[2:], decoded, hidden))


@torch.library.custom_op(
    "lce::fused_into_backward",
    mutates_args=("grad_weight_into",),
    schema=f"({_INPUTS}, {_SAVED}, Tensor(a!) grad_weight_into, str call) -> (Tensor, Tensor)",
)
def fused_into_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    saved: list[torch.Tensor],
    upstream: list[torch.Tensor],
    grad_weight_into: torch.Tensor,
    call: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``into`` route's gradients of hidden and bias (`into_slots`); the buffer settled."""
    decoded = decode_call(call)
    plan = plan_call(decoded, hidden, weight, targets, agree=False)
    grads = into_backward(
        hidden, weight, bias, targets, saved, upstream, grad_weight_into, plan, decoded
    )
    return into_slots([grad for grad in grads if grad is not None], decoded, hidden)


def into_slots(
    grads: list[torch.Tensor], call: Call, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The wanted ``grads`` of hidden and bias in two fixed slots, an empty tensor in an unwanted
    one: functionalization (what lets the compiler run an op that mutates an argument) takes
    fixed tuples of tensors from a mutating op, not a ``Tensor[]``."""
    rest = iter(grads)
    wanted = (call.wanted.hidden, call.wanted.bias)
    return tuple(next(rest) if need else like.new_empty(0) for need in wanted)


def fake_outputs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, call: Call
) -> list[torch.Tensor]:
    """What a forward op returns, as empty tensors of the right shapes and dtypes."""
    acc = accumulation_dtype(weight.dtype)
    tokens, width, vocab = targets.numel(), hidden.shape[-1], weight.shape[0]
    per_token = call.route == "tokens" or call.reduction == "none"
    shape = targets.shape if per_token else ()
    outputs = [hidden.new_empty(shape, dtype=acc) for _ in range(2)]
    if call.route in ("tokens", "loss"):
        stats = hidden.new_empty((len(GlobalStats.__dataclass_fields__), tokens), dtype=acc)
        saved = [*outputs, hidden.new_empty((tokens,), dtype=torch.int64), stats]
        if call.keep_logits:
            saved.append(weight.new_empty((tokens, vocab)))
        return saved
    kept = (
        (call.wanted.hidden, (tokens, width)),
        (call.wanted.weight and call.route == "fast", (vocab, width)),
        (call.wanted.bias, (vocab,)),
    )
    return [*outputs, *(hidden.new_empty(size, dtype=acc) for wanted, size in kept if wanted)]


def fake_grads(hidden: torch.Tensor, weight: torch.Tensor, call: Call) -> list[torch.Tensor]:
    """What a backward op returns: the wanted gradients, shaped and typed like their inputs."""
    kept = (
        (call.wanted.hidden, hidden.shape, hidden.dtype),
        (call.wanted.weight and call.route != "into", weight.shape, weight.dtype),
        (call.wanted.bias, weight.shape[:1], weight.dtype),
    )
    return [hidden.new_empty(shape, dtype=dtype) for wanted, shape, dtype in kept if wanted]


@fused.register_fake
def _fused_fake(hidden, weight, bias, targets, call):
    return fake_outputs(hidden, weight, targets, decode_call(call))


@fused_into.register_fake
def _fused_into_fake(hidden, weight, bias, targets, grad_weight_into, call):
    decoded = decode_call(call)
    outputs = fake_outputs(hidden, weight, targets, decoded)
    return (*outputs[:2], *into_slots(outputs[2:], decoded, hidden))


@fused_backward.register_fake
def _fused_backward_fake(hidden, weight, bias, targets, saved, upstream, call):
    return fake_grads(hidden, weight, decode_call(call))


@fused_into_backward.register_fake
def _fused_into_backward_fake(hidden, weight, bias, targets, saved, upstream, buffer, call):
    decoded = decode_call(call)
    return into_slots(fake_grads(hidden, weight, decoded), decoded, hidden)


def _setup_context(
    ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor], call: Call | None = None
) -> None:
    """Save what `_backward` needs; ``call``: the decoded call where the caller has it (Dynamo
    traces `IntoGradBuffer` itself, and cannot trace `decode_call`'s parser)."""
    hidden, weight, bias, targets, *rest = inputs
    ctx.save_for_backward(hidden, weight, bias, targets, *output[2:])
    ctx.call = rest[-1]
    ctx.decoded = decode_call(rest[-1]) if call is None else call
    # The into route's buffer and Megatron's flags: not saved (megatron's layers keep main_grad
    # out of version checks), and the weight object itself carries the flags.
    ctx.buffer = rest[0] if len(rest) == 2 else None
    ctx.flagged_weight = weight
    # The saved tensors; and the losses' z term (for logging), while entropy is differentiable.
    first = 2 if ctx.decoded.route == "tokens" else 1
    ctx.mark_non_differentiable(*output[first:])
    # No zero-filled gradients for outputs the caller did not use: autograd would otherwise
    # allocate one per output, the saved fp32 [V_local, H] grad_weight of the fast route included
    # (+2 GiB at llama3-8k; `_backward` reads an absent upstream as 0).
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
    call = ctx.decoded
    hidden, weight, bias, targets, *saved = ctx.saved_tensors
    acc = accumulation_dtype(weight.dtype)
    upstream = [hidden.new_zeros((), dtype=acc) if g is None else g for g in grads[:2]]
    # No gradient for: targets, [buffer, the decoded call (`IntoGradBuffer`),] the call's text.
    extra = (None,) * (4 if ctx.buffer is not None else 2)
    if torch.is_grad_enabled():  # create_graph=True: this backward is differentiated too
        wanted = Wanted(*ctx.needs_input_grad[:3])
        plan = plan_call(call, hidden, weight, targets, agree=False)
        result = grads_with_graph(hidden, weight, bias, targets, upstream, plan, call, wanted)
        return (*result, *extra)
    wanted = call.wanted
    if call.route == "into":  # the weight's gradient went to the buffer
        grad_hidden, grad_bias = torch.ops.lce.fused_into_backward(
            hidden, weight, bias, targets, saved, upstream, ctx.buffer, ctx.call
        )
        grad_weight = megatron_weight_grad(ctx.flagged_weight) if wanted.weight else None
        result = [grad_hidden if wanted.hidden else None, grad_weight]
        return (*result, grad_bias if wanted.bias else None, *extra)
    out = list(
        torch.ops.lce.fused_backward(hidden, weight, bias, targets, saved, upstream, ctx.call)
    )
    return (*(out.pop(0) if need else None for need in wanted), *extra)


fused.register_autograd(_backward, setup_context=_setup_context)


class IntoGradBuffer(torch.autograd.Function):
    """`fused_into`'s autograd: torch.library registers autograd formulas for functional ops only,
    and this one adds to the caller's buffer (the point of it: no ``[V_local, H]`` buffer of
    lce's own), so its formula is this function, around the same ops."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        buffer: torch.Tensor,
        text: str,
        call: Call,
    ) -> tuple[torch.Tensor, ...]:
        """``text``: ``call`` encoded (`lce.call.encode_call`)."""
        outputs = torch.ops.lce.fused_into(hidden, weight, bias, targets, buffer, text)
        _setup_context(ctx, (hidden, weight, bias, targets, buffer, text), outputs, call)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return _backward(ctx, list(grads))
