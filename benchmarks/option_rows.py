"""Logit options in the kernel benchmark (issue 31): lce with a softcap or a z-loss against lce
without it on the same inputs (the option's cost) and against the stock materialized path with
the same option (its error), each fwd+bwd. Used by `kernel_gpu.py`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import lce
from verify.numerics.reference import IGNORE_INDEX

# name -> (keyword arguments, modes): Gemma 2's final-logit cap, PaLM/OLMo's z-loss coefficient
# (a loss term: the per-token path has none).
OPTIONS = {
    "softcap 30": ({"softcap": 30.0}, ("mean", "token")),
    "z-loss 1e-4": ({"z_loss": 1e-4}, ("mean",)),
}
MAX_OVERHEAD = 0.03  # issue 31: an option costs at most 3% over the same path without it


def stock_loss_with(options: dict) -> Callable:
    """The stock materialized path with ``options``, in fp32 after the GEMM in the inputs' dtype,
    as a user writes it in PyTorch (Gemma 2's ``cap * tanh(z / cap)``; ``c * lse**2`` per token)."""

    def loss(hidden, weight, targets, mode):
        logits = (hidden @ weight.T).float()
        if options.get("softcap") is not None:
            logits = options["softcap"] * torch.tanh(logits / options["softcap"])
        per_token = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")
        if mode == "token":
            return -per_token
        valid = targets != IGNORE_INDEX
        if options.get("z_loss"):
            lse = torch.logsumexp(logits, dim=-1)
            per_token = per_token + options["z_loss"] * torch.where(valid, lse.square(), 0.0)
        return per_token.sum() / valid.sum()

    return loss


def lce_loss_with(options: dict) -> Callable:
    """lce's Triton backend with ``options`` (mean loss, or per-token log-probs)."""

    def loss(hidden, weight, targets, mode):
        if mode == "mean":
            return lce.linear_cross_entropy(hidden, weight, targets, backend="triton", **options)
        return lce.token_logprobs(hidden, weight, targets, backend="triton", **options).logprobs

    return loss


def verdicts(rows: list[dict]) -> list[str]:
    """One line per option and mode: its time over lce's plain path in the same mode (<= 3%) and
    its grad errors against the stock path's with the same option (no larger)."""
    by_key = {(r["method"], r["mode"]): r for r in rows if "ms" in r}
    lines = []
    for name, (_, modes) in OPTIONS.items():
        for mode in modes:
            lce_row = by_key.get((f"lce triton, {name}", mode))
            plain = by_key.get(("lce triton", mode))
            stock = by_key.get((f"stock PyTorch, {name}", mode))
            if lce_row is None or plain is None or stock is None:
                lines.append(f"{name} {mode}: not judged (a row is missing or failed)")
                continue
            overhead = lce_row["ms"] / plain["ms"] - 1
            worse = [k for k in ("gx_rel", "gw_rel") if lce_row[k] > stock[k]]
            met = overhead <= MAX_OVERHEAD and not worse
            lines.append(
                f"{name} {mode}: {'MET' if met else 'MISSED'}: {lce_row['ms']:.1f} ms = "
                f"{overhead:+.1%} over plain lce (<= {MAX_OVERHEAD:.0%}); grad errors "
                f"{lce_row['gx_rel']:.1e}/{lce_row['gw_rel']:.1e} vs stock "
                f"{stock['gx_rel']:.1e}/{stock['gw_rel']:.1e}"
                + (f" (worse: {', '.join(worse)})" if worse else "")
            )
    return lines
