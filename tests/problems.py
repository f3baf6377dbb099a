"""Small deterministic LCE problems for the core tests: non-uniform weights, peaked rows, ignores.

Every tensor comes from one ``torch.Generator`` seeded by the caller, built in float64, then cast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class Problem:
    hidden: torch.Tensor  # [T, H] in hidden dtype
    weight: torch.Tensor  # [V, H] in weight dtype (global)
    targets: torch.Tensor  # [T] int64, IGNORE where ignored
    grad_logprob: torch.Tensor  # [T] fp32, random
    grad_entropy: torch.Tensor  # [T] fp32, random


def make_problem(
    num_tokens: int,
    hidden_size: int,
    vocab: int,
    hidden_dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype | None = None,
    seed: int = 0,
    ignore_fraction: float = 0.2,
    logit_scale: float = 3.0,
) -> Problem:
    """Rows of weight with log-normal norms and a few tokens whose target logit is the max + 5."""
    gen = torch.Generator().manual_seed(seed)
    weight_dtype = weight_dtype or hidden_dtype
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, dtype=torch.float64)
    row_norms = torch.exp(0.5 * torch.randn(vocab, 1, generator=gen, dtype=torch.float64))
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64) * row_norms
    weight *= logit_scale / hidden_size**0.5
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    peaked = torch.rand(num_tokens, generator=gen) < 0.25
    if vocab > 1 and bool(peaked.any()):
        # Peak: move the hidden row along the target's weight row so its logit dominates.
        direction = weight[targets[peaked]]
        hidden[peaked] += 5.0 * direction / direction.norm(dim=1, keepdim=True).clamp_min(1e-12)
    ignored = torch.rand(num_tokens, generator=gen) < ignore_fraction
    targets[ignored] = IGNORE
    grad_logprob = torch.randn(num_tokens, generator=gen, dtype=torch.float64).float()
    grad_entropy = torch.randn(num_tokens, generator=gen, dtype=torch.float64).float()
    return Problem(
        hidden.to(hidden_dtype),
        weight.to(weight_dtype),
        targets,
        grad_logprob,
        grad_entropy,
    )
