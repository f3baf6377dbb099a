"""`TritonStages`: the StageBackend of fused Triton kernels on one vocab shard.

Forward: `forward_kernel` (one pass of logits tiles, online softmax). Backward: per vocab chunk,
`backward_kernel` recomputes logits and writes d_logits, then two GEMMs (`gemm`) accumulate
grad_hidden and write grad_weight in fp32.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from lce.backends.base import BackwardRows, ShardStats
from lce.backends.gemm import addmm_, mm_into
from lce.backends.triton.backward_kernel import dlogits_chunk
from lce.backends.triton.config import TritonConfig, default_config
from lce.backends.triton.forward_kernel import forward_partials, merge_partials


def _check_operands(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [T, H] and weight [V_local, H]; got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden ({hidden.dtype}) must already be cast to weight's dtype ({weight.dtype})"
        )
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 [T]; got {targets.dtype} {tuple(targets.shape)}")


class TritonStages:
    """Fused Triton stages; ``config`` defaults to `default_config()` at each call."""

    def __init__(self, config: TritonConfig | None = None) -> None:
        self.config = config

    def _config(self) -> TritonConfig:
        return self.config if self.config is not None else default_config()

    def forward_stats(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        temperature: float,
    ) -> ShardStats:
        """See `lce.backends.base.StageBackend.forward_stats` (sumexp_z centred on ``max``)."""
        _check_operands(hidden, weight, targets)
        num_tokens, vocab_local = hidden.shape[0], weight.shape[0]
        if num_tokens == 0 or vocab_local == 0:
            empty = torch.zeros(
                len(fields(ShardStats)), num_tokens, dtype=torch.float32, device=hidden.device
            )
            empty[0] = float("-inf")
            return ShardStats(*empty.unbind(0))
        partials = forward_partials(
            hidden, weight, targets.contiguous(), vocab_start, temperature, self._config()
        )
        return merge_partials(partials)

    def backward_grads(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        temperature: float,
        rows: BackwardRows,
        need_hidden: bool,
        need_weight: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """See `lce.backends.base.StageBackend.backward_grads`; workspace one d_logits chunk."""
        _check_operands(hidden, weight, targets)
        (num_tokens, hidden_size), vocab_local = hidden.shape, weight.shape[0]
        config = self._config()
        device = hidden.device
        grad_hidden = None
        if need_hidden:
            grad_hidden = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=device)
        grad_weight = None
        if need_weight:
            # Every chunk writes its grad_weight rows, so only T = 0 needs the zeros.
            alloc = torch.empty if num_tokens else torch.zeros
            dtype = torch.float32 if config.grad_weight_fp32 else weight.dtype
            grad_weight = alloc(vocab_local, hidden_size, dtype=dtype, device=device)
        if num_tokens == 0 or vocab_local == 0 or not (need_hidden or need_weight):
            return grad_hidden, grad_weight
        width = self._chunk_width(num_tokens, vocab_local, weight.element_size(), config)
        # Rows padded to 16 elements: the kernel's stores stay aligned (vectorized), and its row
        # stride is one compiled specialization whatever V is.
        padded = -(-width // 16) * 16
        buffer = torch.empty(num_tokens, padded, dtype=weight.dtype, device=hidden.device)
        rows = BackwardRows(
            *(s.float().contiguous() for s in (rows.max, rows.log_sumexp, rows.centred_mean)),
            rows.grad_logprob.float(),
            rows.grad_entropy.float(),
            rows.target_grad.float().contiguous(),
        )
        for start in range(0, vocab_local, width):
            chunk = slice(start, min(start + width, vocab_local))
            d_logits = buffer[:, : chunk.stop - start]
            dlogits_chunk(
                hidden, weight[chunk], targets.contiguous(), vocab_start + start, temperature,
                rows, d_logits, config,
            )  # fmt: skip
            if grad_weight is not None:
                mm_into(d_logits.T, hidden, out=grad_weight[chunk])
            if grad_hidden is not None:
                addmm_(grad_hidden, d_logits, weight[chunk])
        return grad_hidden, grad_weight

    @staticmethod
    def _chunk_width(num_tokens: int, vocab_local: int, itemsize: int, config: TritonConfig) -> int:
        """Vocab rows per d_logits chunk: ``chunk_bytes`` worth, whole tiles, at most V_local."""
        block_v = config.backward.block_v
        width = config.chunk_bytes // (num_tokens * itemsize) // block_v * block_v
        return min(vocab_local, max(block_v, width))
