"""A third-party chunked linear cross-entropy, written the way a user would, with a real bug.

The bug (deliberate, for tests/verify/test_adapters.py): ``reduction="mean"`` averages over
every token, ignored ones included (they contribute 0 to the sum but still count in the
denominator), so the loss and its gradients shrink by the fraction of ignored tokens. Everything
else is right. `PAIRED_ROWS` is a second kernel that both raises and fails numerically
(tests/verify/test_search_groups.py).
"""

from __future__ import annotations

import torch

from verify.adapters.builtin import flat_loss_adapter
from verify.adapters.interface import Call

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


def _paired_rows_loss(call: Call, reduction: str) -> torch.Tensor:
    """A second kernel, with two bugs: it assumes an even row count (an ``assert``, not a
    declared limit) and keeps the logits in bf16 (a half-precision tile buffer)."""
    rows = call.hidden.shape[0]
    assert rows % 2 == 0, f"rows are processed in pairs; got {rows}"
    logits = (call.hidden @ call.weight.T).bfloat16().float()
    return torch.nn.functional.cross_entropy(
        logits, call.targets, reduction=reduction, ignore_index=call.ignore_index
    )


# Its adapter declares ValueError as its refusal of an input, so the assert is no refusal: it
# propagates as an error, beside the numerical failures of the even row counts.
PAIRED_ROWS = flat_loss_adapter("paired_rows", _paired_rows_loss, refusals=(ValueError,))
