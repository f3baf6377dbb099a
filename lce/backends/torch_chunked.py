"""Pure-PyTorch backend: the two stages over token chunks, at most ``[chunk, V_local]`` logits.

Logits are ``hidden @ weight.T`` in the inputs' dtype (the stock path's rounding), then fp32 softmax
math (fp64 for fp64 inputs); grad_weight accumulates across chunks in fp32.
"""

from __future__ import annotations

import torch

from lce.backends.base import ShardStats

# Elements of one [chunk, V_local] fp32 block: 16 Mi = 64 MiB, so peak stays a few such blocks.
DEFAULT_CHUNK_ELEMENTS = 1 << 24


def _accumulation_dtype(weight: torch.Tensor) -> torch.dtype:
    """fp32 softmax math and accumulation; fp64 inputs keep fp64 (the exact-invariance checks)."""
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


class TorchChunkedStages:
    """Token-chunked forward statistics and gradients; works on any device torch supports."""

    def __init__(self, chunk_size: int | None = None) -> None:
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 (tokens per chunk), got {chunk_size}")
        self.chunk_size = chunk_size

    def _chunks(self, num_tokens: int, vocab_local: int) -> tuple[range, int]:
        size = self.chunk_size or max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab_local, 1))
        return range(0, num_tokens, size), size

    @staticmethod
    def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
        logits = (hidden @ weight.T).to(_accumulation_dtype(weight))
        if temperature != 1.0:
            logits.mul_(1.0 / temperature)
        return logits

    @staticmethod
    def _local_targets(targets: torch.Tensor, vocab_start: int, vocab_local: int):
        local = targets - vocab_start
        owned = (local >= 0) & (local < vocab_local)
        return local.clamp(0, max(vocab_local - 1, 0)), owned

    def forward_stats(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        temperature: float,
    ) -> ShardStats:
        num_tokens, vocab_local = hidden.shape[0], weight.shape[0]
        out = torch.zeros(4, num_tokens, dtype=_accumulation_dtype(weight), device=hidden.device)
        row_max, sumexp, sumexp_z, target_logit = out.unbind(0)
        if vocab_local == 0:
            row_max.fill_(-torch.inf)
            return ShardStats(row_max, sumexp, sumexp_z, target_logit)
        local, owned = self._local_targets(targets, vocab_start, vocab_local)
        starts, size = self._chunks(num_tokens, vocab_local)
        for start in starts:
            rows = slice(start, start + size)
            z = self._logits(hidden[rows], weight, temperature)
            picked = z.gather(1, local[rows, None]).squeeze(1)
            target_logit[rows] = torch.where(owned[rows], picked, torch.zeros_like(picked))
            m = z.amax(dim=1)
            row_max[rows] = m
            z.sub_(m[:, None])  # centred logits, <= 0
            e = torch.exp(z)
            sumexp[rows] = e.sum(dim=1)
            sumexp_z[rows] = (e.unsqueeze(1) @ z.unsqueeze(2)).view(-1)
        return ShardStats(row_max, sumexp, sumexp_z, target_logit)

    def backward_grads(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        temperature: float,
        lse: torch.Tensor,
        expected_logit: torch.Tensor,
        grad_logprob: torch.Tensor,
        grad_entropy: torch.Tensor,
        need_hidden: bool,
        need_weight: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        num_tokens, hidden_size = hidden.shape
        vocab_local = weight.shape[0]
        device = hidden.device
        grad_hidden = (
            torch.zeros(num_tokens, hidden_size, dtype=_accumulation_dtype(weight), device=device)
            if need_hidden
            else None
        )
        grad_weight = (
            torch.zeros(vocab_local, hidden_size, dtype=_accumulation_dtype(weight), device=device)
            if need_weight
            else None
        )
        if vocab_local == 0 or num_tokens == 0:
            return grad_hidden, grad_weight
        local, owned = self._local_targets(targets, vocab_start, vocab_local)
        entropy = lse - expected_logit
        inv_temp = 1.0 / temperature
        starts, size = self._chunks(num_tokens, vocab_local)
        for start in starts:
            rows = slice(start, start + size)
            g_lp = grad_logprob[rows, None] * inv_temp
            g_ent = grad_entropy[rows, None] * inv_temp
            # d_logits = g_lp (onehot - p) - g_ent p (z - E), with z - E = log p + entropy.
            d = self._logits(hidden[rows], weight, temperature)
            d.sub_(lse[rows, None])  # log p
            p = torch.exp(d)
            d.add_(entropy[rows, None]).mul_(g_ent).add_(g_lp).mul_(p).neg_()
            del p
            onehot_grad = torch.where(owned[rows, None], g_lp, torch.zeros_like(g_lp))
            d.scatter_add_(1, local[rows, None], onehot_grad)
            d = d.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = d @ weight
            if grad_weight is not None:
                if d.dtype == grad_weight.dtype:
                    grad_weight.addmm_(d.T, hidden[rows])
                else:
                    grad_weight += d.T @ hidden[rows]
        return grad_hidden, grad_weight
