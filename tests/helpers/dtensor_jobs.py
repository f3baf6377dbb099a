"""Worker-side jobs of tests/lce/test_dtensor_weights.py: lce called with DTensor weights on a real
`DeviceMesh` over the rank's gloo TP group, and with FSDP2 (`fully_shard`) models.

Every rank builds the same global problem from the payload's seed (no per-rank seeding), except
where a job gives each rank its own tokens on purpose (FSDP's data parallelism).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import lce
from lce.backends.base import accumulation_dtype
from verify.distributed import JobContext

IGNORE_INDEX = -100
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
PATHS = ("tokens", "mean", "fast", "grad_weight_into")
# Upstream of the scalar losses: not 1, so nothing can hide behind a gradient of ones.
LOSS_GRAD = -1.3


def _problem(seed: int, tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype) -> dict:
    """hidden, weight (log-normal row norms), targets (every fourth ignored), the per-token
    upstreams and main_grad's old content: the same on every rank."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[::4] = IGNORE_INDEX
    return {
        "hidden": randn(tokens, hidden_size).to(dtype),
        "weight": (randn(vocab, hidden_size) * randn(vocab, 1).exp()).to(dtype),
        "targets": targets,
        "grad_logprob": randn(tokens),
        "grad_entropy": randn(tokens),
        "main_grad": randn(vocab, hidden_size).to(accumulation_dtype(dtype)),
    }


def _run_path(
    path: str, prob: dict, weight: torch.Tensor, buffer: torch.Tensor, **kwargs: Any
) -> list[torch.Tensor]:
    """One forward and backward of ``path`` with ``weight`` (a leaf: a plain shard or a DTensor):
    the outputs, grad_hidden, then the weight's gradient (main_grad for grad_weight_into) as a
    local tensor."""
    hidden = prob["hidden"].clone().requires_grad_()
    targets = prob["targets"]
    if path == "tokens":
        out = lce.token_logprobs(hidden, weight, targets, **kwargs)
        upstream = [prob[k].to(out.logprobs.dtype) for k in ("grad_logprob", "grad_entropy")]
        torch.autograd.backward([out.logprobs, out.entropy], upstream)
        outputs = [out.logprobs, out.entropy]
    else:
        if path == "fast":
            kwargs.update(fast=True, reduction="sum")
        if path == "grad_weight_into":
            kwargs.update(grad_weight_into=buffer)
        loss = lce.linear_cross_entropy(hidden, weight, targets, **kwargs)
        loss.backward(torch.tensor(LOSS_GRAD, dtype=loss.dtype))
        outputs = [loss]
    weight_grad = buffer if path == "grad_weight_into" else weight.grad
    return [t.detach() for t in (*outputs, hidden.grad, _local(weight_grad))]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _chunk_bounds(vocab: int, size: int, rank: int) -> tuple[int, int]:
    """``torch.chunk``'s rows of ``rank``: DTensor's Shard(0) split, worked out independently."""
    step = -(-vocab // size)
    start = min(rank * step, vocab)
    return start, min(start + step, vocab)


def shard0_equals_tp(payload: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """Every path with a Shard(0) DTensor weight against the same path with this rank's rows and
    ``tp_group``/``vocab_start``: which outputs differ in any bit, and the gradient placements."""
    prob = _problem(payload["seed"], 10, 16, payload["vocab"], DTYPES[payload["dtype"]])
    start, stop = _chunk_bounds(payload["vocab"], ctx.tp_size, ctx.tp_rank)
    plain = {"tp_group": ctx.tp_group, "vocab_start": start}
    result = _against_plain(prob, ctx, Shard(0), slice(start, stop), plain, payload["backend"])
    return {**result, "rows": (start, stop)}


def replicate_runs_locally(payload: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """A Replicate DTensor weight against the plain whole weight, without TP."""
    prob = _problem(payload["seed"], 10, 16, 37, torch.float64)
    return _against_plain(prob, ctx, Replicate(), slice(None), {}, "torch")


def _against_plain(
    prob: dict, ctx: JobContext, placement: Any, rows: slice, plain_kwargs: dict, backend: str
) -> dict[str, Any]:
    """Each path with the weight (and main_grad) as a DTensor of ``placement`` on the TP group's
    mesh, and with their ``rows`` as plain tensors and ``plain_kwargs``: the outputs that differ in
    any bit, and the DTensor weight's gradient placements."""
    mesh = DeviceMesh.from_group(ctx.tp_group, "cpu")
    common = {"backend": backend, "chunk_size": 4}
    differ, placements = [], []
    for path in PATHS:
        weight = prob["weight"][rows].clone().requires_grad_()
        buffer = prob["main_grad"][rows].clone()
        plain = _run_path(path, prob, weight, buffer, **plain_kwargs, **common)
        dweight = distribute_tensor(prob["weight"], mesh, [placement]).requires_grad_()
        dbuffer = distribute_tensor(prob["main_grad"], mesh, [placement])
        got = _run_path(path, prob, dweight, dbuffer, **common)
        pairs = enumerate(zip(got, plain, strict=True))
        differ += [f"{path}[{i}]" for i, (a, b) in pairs if not a.equal(b)]
        if path != "grad_weight_into":
            placements.append(str(dweight.grad.placements))
    return {"differ": differ, "placements": placements}


def refusals(payload: dict[str, Any], ctx: JobContext) -> dict[str, str]:
    """The error each refused call raised (type: message), by case."""
    prob = _problem(payload["seed"], 6, 16, 12, torch.float64)
    mesh = DeviceMesh.from_group(ctx.tp_group, "cpu")
    hidden, weight, targets = prob["hidden"], prob["weight"], prob["targets"]
    local_rows = weight.chunk(ctx.tp_size)[ctx.tp_rank]
    cases: dict[str, Callable[[], object]] = {
        "shard1": lambda: lce.token_logprobs(
            hidden, distribute_tensor(weight, mesh, [Shard(1)]), targets
        ),
        "partial": lambda: lce.linear_cross_entropy(
            hidden, DTensor.from_local(weight / ctx.tp_size, mesh, [Partial()]), targets
        ),
        "dtensor_hidden": lambda: lce.token_logprobs(
            distribute_tensor(hidden, mesh, [Shard(0)]), weight, targets
        ),
        "dtensor_targets": lambda: lce.token_logprobs(
            hidden, weight, distribute_tensor(targets, mesh, [Replicate()])
        ),
        "tp_group_too": lambda: lce.token_logprobs(
            hidden, distribute_tensor(weight, mesh, [Shard(0)]), targets, tp_group=ctx.tp_group
        ),
        "plain_buffer": lambda: lce.linear_cross_entropy(
            hidden,
            distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_(),
            targets,
            grad_weight_into=torch.zeros_like(local_rows),
        ),
        "dtensor_buffer_plain_weight": lambda: lce.linear_cross_entropy(
            hidden,
            weight.clone().requires_grad_(),
            targets,
            grad_weight_into=distribute_tensor(torch.zeros_like(weight), mesh, [Shard(0)]),
        ),
    }
    last = ctx.tp_rank == ctx.tp_size - 1
    cases["tokens_differ"] = lambda: lce.token_logprobs(  # one rank short of a token
        hidden[1:] if last else hidden, distribute_tensor(weight, mesh, [Shard(0)]),
        targets[1:] if last else targets,
    )  # fmt: skip
    if ctx.tp_size == 4 and dist.get_world_size() == 4:  # a 2-D mesh over the whole world
        mesh_2d = DeviceMesh("cpu", torch.arange(4).view(2, 2))
        cases["mesh_2d"] = lambda: lce.token_logprobs(
            hidden, distribute_tensor(weight, mesh_2d, [Shard(0), Replicate()]), targets
        )
    return {name: _error_of(call) for name, call in cases.items()}


def _error_of(call: Callable[[], object]) -> str:
    try:
        call()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


class TinyLM(nn.Module):
    """A body and an LM head whose forward the loss never calls (the fused-loss pattern)."""

    def __init__(self, hidden_size: int, vocab: int) -> None:
        super().__init__()
        self.body = nn.Linear(hidden_size, hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(x))


def fsdp2_loss(payload: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` on the TP group's mesh, data parallel) against the unsharded model.

    ``mode``: ``separate`` (the head its own FSDP unit, its weight passed sharded), ``same_tokens``
    (that, with every rank given the same tokens), ``unshard`` (the documented fix:
    ``model.lm_head.unshard()`` before the loss), ``root`` (the head in the root unit, whose
    forward leaves it unsharded). The reference runs the plain model on each rank's tokens and
    averages the gradients over the ranks, as FSDP does. Returns the error, or how far the loss
    and each parameter's gradient are from the reference's.
    """
    hidden_size, vocab, tokens = 8, 11, 6
    mode = payload["mode"]
    torch.manual_seed(0)
    reference = TinyLM(hidden_size, vocab).double()
    model = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(100 + (0 if mode == "same_tokens" else ctx.tp_rank))
    x = torch.randn(tokens, hidden_size, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    loss_ref = lce.linear_cross_entropy(reference(x), reference.lm_head.weight, targets)
    (LOSS_GRAD * loss_ref).backward()
    for param in reference.parameters():
        dist.all_reduce(param.grad, group=ctx.tp_group)
        param.grad /= ctx.tp_size  # exact: a power of two
    mesh = DeviceMesh.from_group(ctx.tp_group, "cpu")
    if mode != "root":
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    hidden = model(x)
    if mode == "unshard":
        model.lm_head.unshard()
    try:
        loss = lce.linear_cross_entropy(hidden, model.lm_head.weight, targets)
    except ValueError as error:
        return {"error": str(error)}
    (LOSS_GRAD * loss).backward()
    pairs = {"loss": (loss, loss_ref)}
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        pairs[name] = (param.grad.full_tensor(), ref.grad)
    return {
        "error": "",
        # Per output: (max |got - reference|, max |reference|).
        "errors": {
            k: ((a - b).abs().max().item(), b.abs().max().item()) for k, (a, b) in pairs.items()
        },
        "resharded": isinstance(model.lm_head.weight, DTensor),
    }
