"""The lce job the pool runs in tests and benchmarks: one TP rank's forward + backward.

Every rank rebuilds the same global float64 problem from the case's seed (never a per-rank seed),
casts it, takes its own contiguous vocab rows, and runs `lce.token_logprobs` forward and backward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import lce
from verify.distributed.worker import JobContext

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LceCase:
    """A vocab-parallel problem: sizes, dtype, data seed and how to run lce."""

    seed: int
    tokens: int
    hidden: int
    vocab: int
    dtype: str = "float32"
    backend: str = "torch"
    chunk_size: int | None = None
    temperature: float = 1.0
    ignore_fraction: float = 0.25


@dataclass(frozen=True)
class GlobalProblem:
    """float64 tensors of the whole problem; ``targets`` hold global ids or ``IGNORE_INDEX``."""

    hidden: torch.Tensor  # [T, H]
    weight: torch.Tensor  # [V, H]
    targets: torch.Tensor  # [T] int64
    grad_logprob: torch.Tensor  # [T] upstream gradient of logprobs
    grad_entropy: torch.Tensor  # [T] upstream gradient of entropy


def build_problem(case: LceCase) -> GlobalProblem:
    """The global problem of ``case``, identical on every rank and at every TP degree.

    Weight rows get log-normal norms and a quarter of the tokens a peaked target (hidden moved along
    the target row), so the softmax is far from uniform; upstream gradients are random per token.
    """
    gen = torch.Generator("cpu").manual_seed(case.seed)
    hidden = _normal(gen, case.tokens, case.hidden)
    norms = torch.exp(0.5 * _normal(gen, case.vocab, 1))
    weight = _normal(gen, case.vocab, case.hidden).mul_(norms * (3.0 / case.hidden**0.5))
    targets = torch.randint(0, case.vocab, (case.tokens,), generator=gen)
    peaked = torch.rand(case.tokens, generator=gen) < 0.25
    direction = weight[targets[peaked]]
    hidden[peaked] += 5.0 * direction / direction.norm(dim=1, keepdim=True).clamp_min(1e-12)
    targets[torch.rand(case.tokens, generator=gen) < case.ignore_fraction] = IGNORE_INDEX
    grad_logprob = _normal(gen, case.tokens)
    grad_entropy = _normal(gen, case.tokens)
    return GlobalProblem(hidden, weight, targets, grad_logprob, grad_entropy)


def _normal(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Standard normal draws as float64; drawn in float32 because float64 draws are ~6x slower on
    CPU (100 ms for a 8192 x 256 weight), then every later operation is in float64."""
    return torch.randn(*shape, generator=gen, dtype=torch.float32).double()


def shard_bounds(vocab: int, tp_size: int) -> list[int]:
    """Contiguous, possibly unequal shards: rank r holds ids ``[b[r], b[r+1])``."""
    return [vocab * rank // tp_size for rank in range(tp_size + 1)]


def lce_forward_backward(case: LceCase, ctx: JobContext) -> dict[str, object]:
    """Run lce on this rank's shard; returns fp32 outputs, grads and the compute time.

    ``grad_hidden`` is the TP-reduced ``[T, H]`` gradient (identical on every rank);
    ``grad_weight`` is this rank's ``[V_local, H]`` rows starting at ``vocab_start``.
    ``compute_s`` covers the lce forward and backward only (not the problem build).
    """
    problem = build_problem(case)
    bounds = shard_bounds(case.vocab, ctx.tp_size)
    start, end = bounds[ctx.tp_rank], bounds[ctx.tp_rank + 1]
    dtype = getattr(torch, case.dtype)
    hidden = problem.hidden.to(ctx.device, dtype).requires_grad_()
    weight = problem.weight[start:end].to(ctx.device, dtype).requires_grad_()
    targets = problem.targets.to(ctx.device)
    grads = [g.to(ctx.device, torch.float32) for g in (problem.grad_logprob, problem.grad_entropy)]
    began = time.perf_counter()
    out = lce.token_logprobs(
        hidden,
        weight,
        targets,
        ignore_index=IGNORE_INDEX,
        temperature=case.temperature,
        tp_group=ctx.tp_group,
        vocab_start=start,
        backend=case.backend,
        chunk_size=case.chunk_size,
    )
    torch.autograd.backward([out.logprobs, out.entropy], grads)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    compute_s = time.perf_counter() - began
    return {
        "logprobs": out.logprobs.detach(),
        "entropy": out.entropy.detach(),
        "grad_hidden": hidden.grad,
        "grad_weight": weight.grad,
        "vocab_start": start,
        "compute_s": compute_s,
    }
