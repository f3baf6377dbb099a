"""lce's entry points run under ``torch.compile(fullgraph=True)`` and in eager on the same inputs,
forward and backward, at several token counts: what the compile tests compare (in one process,
and on each rank of a gloo TP group as a worker job)."""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.utils import counters

import lce
from verify.distributed import JobContext

HIDDEN_SIZE, VOCAB = 16, 40
# Each token count a new shape: the first compiles a static graph, the second a dynamic one
# (Dynamo's automatic dynamic shapes), the others must reuse it.
TOKEN_COUNTS = (13, 7, 20, 33)
MAP_OPTIONS = ("temperature", "logit_scale", "softcap")
ALL_OPTIONS = dict(temperature=0.7, logit_scale=1.3, softcap=5.0, z_loss=0.05, label_smoothing=0.2)


def problem(tokens: int, seed: int, rank: int = 0, size: int = 1) -> dict[str, torch.Tensor]:
    """Gaussian hidden, weight rows of log-normal scale (uniform weights hide bugs), a bias, every
    fourth target ignored, random upstream gradients; this rank's vocab rows of weight and bias."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, HIDDEN_SIZE, generator=gen)
    weight = weight * torch.randn(VOCAB, 1, generator=gen).exp()
    bias = torch.randn(VOCAB, generator=gen)
    hidden = torch.randn(tokens, HIDDEN_SIZE, generator=gen)
    targets = torch.randint(0, VOCAB, (tokens,), generator=gen)
    targets[::4] = -100
    rows = slice(rank * VOCAB // size, (rank + 1) * VOCAB // size)
    return {
        "hidden": hidden, "weight": weight[rows].contiguous(), "bias": bias[rows].contiguous(),
        "targets": targets, "upstream": torch.randn(2, tokens, generator=gen),
    }  # fmt: skip


def entry(path: str, options: dict[str, float], backend: str, tp_group: Any = None):
    """The call of one loss path with its outputs as a tuple: ``tokens`` (`lce.token_logprobs`),
    ``loss`` (the default scalar loss and its z term), ``fast``, ``into`` (``grad_weight_into``,
    whose buffer is the last argument)."""
    common = dict(backend=backend, tp_group=tp_group)

    def call(hidden, weight, bias, targets, buffer=None):
        if path == "tokens":
            kept = {name: options[name] for name in MAP_OPTIONS if name in options}
            out = lce.token_logprobs(hidden, weight, targets, bias=bias, **kept, **common)
            return out.logprobs, out.entropy
        return lce.linear_cross_entropy(
            hidden, weight, targets, bias=bias, return_z_loss=True, fast=path == "fast",
            grad_weight_into=buffer, **options, **common,
        )  # fmt: skip

    return call


def run(call, inputs: dict[str, torch.Tensor], path: str) -> list[torch.Tensor]:
    """Outputs, then the gradients of hidden, weight (the buffer for ``into``) and bias, of the
    objective ``sum(upstream * output)`` (a scalar loss's upstream: one random number, 0.7 + its
    first)."""
    leaves = ("hidden", "weight", "bias")
    hidden, weight, bias = (inputs[name].clone().requires_grad_() for name in leaves)
    buffer = torch.zeros_like(weight) if path == "into" else None
    outputs = call(hidden, weight, bias, inputs["targets"], buffer)
    upstream = inputs["upstream"]
    if path == "tokens":
        objective = (outputs[0] * upstream[0]).sum() + (outputs[1] * upstream[1]).sum()
    else:
        objective = outputs[0] * (0.7 + upstream[0, 0])
    objective.backward()
    grad_weight = buffer if path == "into" else weight.grad
    return [out.detach() for out in outputs] + [hidden.grad, grad_weight, bias.grad]


def compiled_and_eager(
    path: str,
    options: dict[str, float],
    backend: str,
    seed: int = 0,
    tp_group: Any = None,
    rank: int = 0,
    size: int = 1,
    compiler: str = "inductor",
) -> dict[str, Any]:
    """Both runs at each of `TOKEN_COUNTS`, and what Dynamo counted: graph breaks and graphs.
    ``compiler``: torch.compile's backend."""
    torch._dynamo.reset()
    counters.clear()
    call = entry(path, options, backend, tp_group)
    compiled = torch.compile(call, backend=compiler, fullgraph=True)
    runs = []
    for tokens in TOKEN_COUNTS:
        inputs = problem(tokens, seed + tokens, rank, size)
        if backend == "triton" and torch.cuda.is_available():  # compiled kernels (GPU nightly)
            inputs = {name: tensor.cuda() for name, tensor in inputs.items()}
        runs.append((run(compiled, inputs, path), run(call, inputs, path)))
    return {
        "runs": runs,
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
    }


def compiled_against_eager(payload: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """`compiled_and_eager` on this rank's shard (``payload``: its keyword arguments)."""
    return compiled_and_eager(tp_group=ctx.tp_group, rank=ctx.tp_rank, size=ctx.tp_size, **payload)
