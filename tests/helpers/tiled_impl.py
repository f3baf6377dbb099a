"""A third-party loss whose bug shows only past a tile boundary the generator's own sizes never
cross: vocabulary chunks of 4096 ids, the last one zero-padded to full width with its padding's
logits left at 0 instead of -inf (every row's logsumexp gains ``exp(0)`` terms). One chunk, and
right, while V <= 4096."""

from __future__ import annotations

import torch
from torch.nn import functional as F

CHUNK = 4096


def padded_vocab_chunks(hidden, weight, targets, *, reduction="mean", ignore_index=-100):
    logits = (hidden @ weight.T).float()
    vocab = logits.shape[1]
    if vocab > CHUNK:
        logits = F.pad(logits, (0, -vocab % CHUNK))
    lse = torch.cat([c.logsumexp(1, keepdim=True) for c in logits.split(CHUNK, 1)], 1)
    valid = targets != ignore_index
    picked = logits.gather(1, torch.where(valid, targets, 0)[:, None])[:, 0]
    losses = torch.where(valid, lse.logsumexp(1) - picked, 0.0)
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.sum() / valid.sum()
