"""Plain loss functions returning the loss in the input dtype (a contract of input-dtype outputs):
one rounds it once, from float64 math on the rounded logits, as a careful kernel does; the other
also rounds the log-sum-exp to the input dtype before subtracting the target's logit (one
extra rounding, the most common complaint about fused kernels' low-precision outputs)."""

from __future__ import annotations

import torch


def _rows(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int):
    logits = (hidden @ weight.T).double()  # rounded to the input dtype, as a linear layer's
    valid = targets != ignore_index
    target = logits.gather(1, torch.where(valid, targets, 0)[:, None])[:, 0]
    return logits.logsumexp(-1), target, valid


def _reduced(per_token: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    per_token = torch.where(valid, per_token, 0.0)
    if reduction == "none":
        return per_token
    total = per_token.sum()
    return total if reduction == "sum" else total / valid.sum()


def rounded_once(hidden, weight, targets, *, reduction="mean", ignore_index=-100):
    lse, target, valid = _rows(hidden, weight, targets, ignore_index)
    return _reduced(lse - target, valid, reduction).to(hidden.dtype)


def rounded_twice(hidden, weight, targets, *, reduction="mean", ignore_index=-100):
    lse, target, valid = _rows(hidden, weight, targets, ignore_index)
    lse = lse.to(hidden.dtype).double()  # the extra rounding
    return _reduced(lse - target, valid, reduction).to(hidden.dtype)
