"""The per-token loss of `lce.linear_cross_entropy` from the token statistics, and its gradient.

One formula for every loss path: the default path applies `token_loss` to the differentiable
per-token outputs, the 3-GEMM paths to the merged statistics, with `loss_upstream` as its
derivative (the upstream each statistic then receives).
"""

from __future__ import annotations

import torch

from lce.backends.base import TokenUpstream
from lce.options import LogitOptions


def token_loss(
    logprob: torch.Tensor, lse: torch.Tensor, smooth: torch.Tensor, logit: LogitOptions
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(loss, z_term)`` per token: ``loss = -(1 - eps) logprob + eps smooth + z_term`` with
    ``z_term = c lse**2``, added only when ``c = logit.z_loss > 0`` (else None), and the smoothing
    term only when ``eps = logit.label_smoothing > 0`` (so the plain loss is exactly -logprob).
    Zero where all three statistics are (ignored tokens)."""
    eps, c = logit.label_smoothing, logit.z_loss
    loss = -logprob if eps == 0 else (eps - 1.0) * logprob + eps * smooth
    z_term = None
    if c > 0:
        z_term = c * lse.square()
        loss = loss + z_term
    return loss, z_term


def loss_upstream(grad_loss: torch.Tensor, lse: torch.Tensor, logit: LogitOptions) -> TokenUpstream:
    """The upstream gradients on the token statistics of ``sum(grad_loss * token_loss)``."""
    eps, c = logit.label_smoothing, logit.z_loss
    zero = torch.zeros_like(grad_loss)
    return TokenUpstream(
        logprob=(eps - 1.0) * grad_loss if eps else -grad_loss,
        entropy=zero,
        lse=2.0 * c * lse * grad_loss if c > 0 else zero,
        smooth=eps * grad_loss if eps else zero,
    )
