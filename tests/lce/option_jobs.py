"""Worker-side jobs of the option tests: lce called on real gloo TP groups with logit options."""

from __future__ import annotations

from typing import Any

import torch

import lce
from verify.distributed import JobContext


def call_with_rank_options(payload: dict[str, Any], ctx: JobContext) -> dict[str, str]:
    """Every rank calls `lce.linear_cross_entropy` on the same tokens with its own shard and the
    keyword options ``payload["options"][tp_rank]``; returns the error each rank raised."""
    gen = torch.Generator().manual_seed(8)
    num_tokens, hidden_size, vocab_local = 5, 6, 4
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, requires_grad=True)
    weight = torch.randn(vocab_local * ctx.tp_size, hidden_size, generator=gen)
    targets = torch.randint(0, vocab_local * ctx.tp_size, (num_tokens,), generator=gen)
    start = ctx.tp_rank * vocab_local
    try:
        lce.linear_cross_entropy(
            hidden, weight[start : start + vocab_local], targets, tp_group=ctx.tp_group,
            backend=payload["backend"], **payload["options"][ctx.tp_rank],
        )  # fmt: skip
    except (TypeError, ValueError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": ""}
