"""A user's chunked linear cross-entropy (the code under test): per-token log-probs and entropy.

Stands for any kernel a team maintains (a vendored Triton kernel in an RL trainer, an NPU port):
it only has to be callable from PyTorch and differentiable. Like such kernels it computes no loss
and has limits it asserts: H a multiple of 128 (its tile), contiguous inputs.
"""

from __future__ import annotations

import torch


def token_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [N, H]``, ``weight [V, H]``, ``targets [N]`` -> fp32 ``(logprobs, entropy)`` of
    ``softmax(hidden @ weight.T / temperature)``; 0 where ``targets == ignore_index``."""
    assert hidden.shape[1] % 128 == 0, "hidden_size must be a multiple of 128"
    assert hidden.is_contiguous() and weight.is_contiguous()
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    logprobs, entropy = [], []
    for rows, ids, keep in zip(
        hidden.split(chunk_tokens),
        safe.split(chunk_tokens),
        valid.split(chunk_tokens),
        strict=True,
    ):
        logits = (rows.to(weight.dtype) @ weight.T).float() / temperature
        logp = logits.log_softmax(dim=-1)
        token = logp.gather(1, ids[:, None]).squeeze(1)
        ent = -(logp.exp() * logp).sum(dim=-1)
        logprobs.append(torch.where(keep, token, 0.0))
        entropy.append(torch.where(keep, ent, 0.0))
    return torch.cat(logprobs), torch.cat(entropy)
