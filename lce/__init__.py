"""lce: fused linear cross-entropy — log-probs, entropy and loss of ``hidden @ weight.T`` without
materializing the ``[tokens, vocab]`` logits, with vocab-parallel tensor parallelism."""

from lce.api import TokenOutputs, linear_cross_entropy, token_logprobs
from lce.options import LCEOptions, LogitOptions

__all__ = ["LCEOptions", "LogitOptions", "TokenOutputs", "linear_cross_entropy", "token_logprobs"]
