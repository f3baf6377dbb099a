"""A third-party chunked linear cross-entropy, written the way a user would, with a real bug.

The bug (deliberate, for tests/test_adapters.py): ``reduction="mean"`` averages over every token,
ignored ones included (they contribute 0 to the sum but still count in the denominator), so the
loss and its gradients shrink by the fraction of ignored tokens. Everything else is right.
"""

from __future__ import annotations

import torch

CHUNK_TOKENS = 4


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` (``hidden [N, H]``, ``targets [N]``), by chunks."""
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    losses = []
    for chunk, chunk_targets, chunk_valid in zip(
        hidden.split(CHUNK_TOKENS), safe.split(CHUNK_TOKENS), valid.split(CHUNK_TOKENS), strict=True
    ):
        logits = (chunk @ weight.T).float()
        target_logit = logits.gather(1, chunk_targets[:, None]).squeeze(1)
        losses.append(torch.where(chunk_valid, logits.logsumexp(-1) - target_logit, 0.0))
    loss = torch.cat(losses)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.mean()  # the bug: the mean counts ignored tokens
