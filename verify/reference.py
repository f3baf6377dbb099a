"""The float64 materialized reference R and the stock low-precision baseline B (tolerance model).

Both materialize the full ``[T, V]`` logits and use autograd. Both see the *same rounded inputs* as
the kernel: hidden is first cast to weight's dtype (as lce does for the matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Reference:
    """float64 per-token outputs ``[T]``; gradients of ``sum(g_lp*logprobs + g_ent*entropy)``."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    valid: torch.Tensor  # bool [T]: target not ignored
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None

    def loss(self, reduction: str) -> torch.Tensor:
        """``-logprobs`` reduced like `lce.linear_cross_entropy` (mean over valid tokens)."""
        if reduction == "none":
            return -self.logprobs
        total = -self.logprobs.sum()
        return total if reduction == "sum" else total / self.valid.sum()


def loss_upstream_grad(
    valid: torch.Tensor, reduction: str, grad_loss: torch.Tensor
) -> torch.Tensor:
    """The upstream gradient on logprobs implied by a loss with ``reduction`` and ``grad_loss``."""
    if reduction == "none":
        return -grad_loss
    scale = grad_loss if reduction == "sum" else grad_loss / valid.sum()
    return (-scale).expand(valid.shape)


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    grad_logprob: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> Reference:
    """R: float64 outputs for ``hidden [T, H]``, the *global* ``weight [V, H]`` and ``targets [T]``.

    Gradients are computed when at least one upstream gradient ``[T]`` is given.
    """
    rounded = hidden.detach().to(weight.dtype).to(torch.float64)
    return _materialized(
        rounded, weight.detach().to(torch.float64), targets, ignore_index, temperature,
        grad_logprob, grad_entropy, math_dtype=torch.float64,
    )  # fmt: skip


def baseline(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    grad_logprob: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> Reference:
    """B: what a user runs instead — logits materialized in weight's dtype, then fp32 softmax.

    Same arguments as `reference`; results come back as float64 for comparison.
    """
    math_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    return _materialized(
        hidden.detach().to(weight.dtype), weight.detach(), targets, ignore_index, temperature,
        grad_logprob, grad_entropy, math_dtype=math_dtype,
    )  # fmt: skip


def _materialized(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    temperature: float,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    math_dtype: torch.dtype,
) -> Reference:
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logp_all = torch.log_softmax((h @ w.T).to(math_dtype) / temperature, dim=-1)
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets)).long()
    picked = logp_all.gather(1, safe_targets[:, None]).squeeze(1)
    # -sum p log p with p log p -> 0 as p -> 0 (an underflowed p would give 0 * -inf otherwise)
    p = logp_all.exp()
    plogp = torch.where(p > 0, p * logp_all, torch.zeros_like(p))
    zero = torch.zeros_like(picked)
    logprobs = torch.where(valid, picked, zero)
    entropy = torch.where(valid, -plogp.sum(dim=-1), zero)
    grad_hidden = grad_weight = None
    if grad_logprob is not None or grad_entropy is not None:
        objective = torch.zeros((), dtype=math_dtype)
        for output, upstream in ((logprobs, grad_logprob), (entropy, grad_entropy)):
            if upstream is not None:
                objective = objective + (output * upstream.to(math_dtype)).sum()
        grads = torch.autograd.grad(objective, (h, w), allow_unused=True)
        grad_hidden, grad_weight = (
            torch.zeros_like(x, dtype=torch.float64) if g is None else g.to(torch.float64)
            for g, x in zip(grads, (h, w), strict=True)
        )
    return Reference(
        logprobs.detach().double(), entropy.detach().double(), valid, grad_hidden, grad_weight
    )
