"""The float64 materialized reference R and the stock low-precision baseline B (tolerance model).

Both materialize the full ``[T, V]`` logits. Both see the *same rounded inputs* as the kernel:
hidden is first cast to weight's dtype (as lce does for the matmul).

R is the same bits on every machine, so a failure artifact's reference replays bit for bit
anywhere: every sum is a fixed sequence of IEEE additions (`ordered_sum`), never a BLAS GEMM or a
vectorized reduction (their order depends on the CPU: AVX2 and AVX-512 give different float64
bits), exp and log are built from basic operations (`verify.numerics.portable_math`; torch's
differ by an ulp between builds), and its gradients are closed-form. B is what users run (BLAS,
autograd), bits and all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verify.numerics import portable_math

# The target id of an ignored token in every case, test and reference (lce's default).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Reference:
    """float64 per-token outputs ``[T]``; gradients of ``sum(g_lp*logprobs + g_ent*entropy)``."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    valid: torch.Tensor  # bool [T]: target not ignored
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None
    # (|d_logits| @ |W|, |d_logits|^T @ |h|) when asked for: the sums of the absolute terms of
    # each gradient element, which bound the rounding of any order of summing them.
    magnitudes: tuple[torch.Tensor, torch.Tensor] | None = None
    d_logits: torch.Tensor | None = None  # [T, V], with the magnitudes: each rank's share of them

    def loss(self, reduction: str) -> torch.Tensor:
        """``-logprobs`` reduced like `lce.linear_cross_entropy` (mean over valid tokens)."""
        if reduction == "none":
            return -self.logprobs
        total = -self.logprobs.sum()
        return total if reduction == "sum" else total / self.valid.sum()


def loss_upstream_grad(
    valid: torch.Tensor, reduction: str, grad_loss: torch.Tensor
) -> torch.Tensor:
    """The upstream gradient on logprobs implied by a loss with ``reduction`` and ``grad_loss``."""
    if reduction == "none":
        return -grad_loss
    scale = grad_loss if reduction == "sum" else grad_loss / valid.sum()
    return (-scale).expand(valid.shape)


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    temperature: float = 1.0,
    grad_logprob: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
    magnitudes: bool = False,
) -> Reference:
    """R: float64 outputs for ``hidden [T, H]``, the *global* ``weight [V, H]`` and ``targets [T]``.

    Gradients are computed when at least one upstream gradient ``[T]`` is given: those of
    ``sum(g_lp * logprobs + g_ent * entropy)``, ``d_z = g_lp (onehot - p) - g_ent p (log p + H)``;
    ``magnitudes`` adds their absolute-term sums (`Reference.magnitudes`).
    """
    h = hidden.detach().to(weight.dtype).to(torch.float64)
    w = weight.detach().to(torch.float64)
    z = ordered_matmul(h, w.T) / temperature
    shifted = z - z.amax(dim=-1, keepdim=True)
    log_p = shifted - _centred_log_sumexp(shifted)[:, None]
    p = portable_math.exp(log_p)
    per_token = _per_token(log_p, p, targets, ignore_index, ordered_sum)
    logprobs, entropy, valid, safe_targets = per_token
    zero = torch.zeros_like(logprobs)
    grad_hidden = grad_weight = None
    if grad_logprob is not None or grad_entropy is not None:
        g_lp, g_ent = (
            zero if g is None else torch.where(valid, g.detach().to(torch.float64), zero)
            for g in (grad_logprob, grad_entropy)
        )
        d_z = g_lp[:, None] * _onehot_minus_p(p, safe_targets) - g_ent[:, None] * (
            p * (log_p + entropy[:, None])
        )
        d_logits = d_z / temperature
        grad_hidden, grad_weight = ordered_matmul(d_logits, w), ordered_matmul(d_logits.T, h)
        if magnitudes:
            size = d_logits.abs()
            sums = (ordered_matmul(size, w.abs()), ordered_matmul(size.T, h.abs()))
            return Reference(logprobs, entropy, valid, grad_hidden, grad_weight, sums, d_logits)
    return Reference(logprobs, entropy, valid, grad_hidden, grad_weight)


def _centred_log_sumexp(shifted: torch.Tensor) -> torch.Tensor:
    """``log sum_j exp(shifted_j)`` of rows whose max is 0, as ``log1p`` of every term but one
    max lane's (exactly 1): on a confident row ``1 + tiny`` would round to 1, making the log-prob
    of the target exactly 0 and R no more precise than an fp64 implementation it judges."""
    terms = portable_math.exp(shifted)
    max_lane = shifted.argmax(dim=-1, keepdim=True)  # the first max lane: the same on every machine
    return portable_math.log1p(ordered_sum(terms.scatter(-1, max_lane, 0.0), dim=-1))


def _onehot_minus_p(p: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``onehot(targets) - p`` with the target lane's ``1 - p_y`` summed from the other lanes'
    ``p``: as a difference it would carry ``p_y``'s rounding, u * 1, which on a confident row
    (fp64 peaked rows; fp32 rows with ``1 - p_y`` below 1e-16) is most or all of the value, so
    R was off where careful implementations are not (lce keeps ``1 - p_y`` uncancelled)."""
    complement = ordered_sum(p.scatter(1, targets[:, None], 0.0), dim=-1)
    return (-p).scatter(1, targets[:, None], complement[:, None])


def _per_token(
    log_p: torch.Tensor,
    p: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    row_sum: Callable,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs, entropy, valid, safe_targets) from ``[T, V]`` log-probabilities and ``p``;
    ignored rows give 0. ``row_sum(x, dim=-1)`` sums the vocabulary (R's fixed order, or B's
    torch.sum)."""
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets)).long()
    zero = log_p.new_zeros(len(targets))
    logprobs = torch.where(valid, log_p.gather(1, safe_targets[:, None]).squeeze(1), zero)
    # -sum p log p with p log p -> 0 as p -> 0 (an underflowed p would give 0 * -inf otherwise)
    plogp = torch.where(p > 0, p * log_p, torch.zeros_like(p))
    entropy = torch.where(valid, -row_sum(plogp, dim=-1), zero)
    return logprobs, entropy, valid, safe_targets


# Elements of the [rows, K, N] products `ordered_matmul` holds at once (64 MiB of float64).
_PRODUCT_ELEMENTS = 1 << 23


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.sum(dim)`` as a fixed pairwise tree of elementwise additions (same bits everywhere)."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    x = torch.nn.functional.pad(x, (0, width - n)) if n else x.new_zeros(*x.shape[:-1], 1)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x.squeeze(-1)


def ordered_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (float64 ``[M, K] @ [K, N]``) summed over K by `ordered_sum`, in row blocks."""
    rows = max(1, _PRODUCT_ELEMENTS // max(1, a.shape[1] * b.shape[1]))
    blocks = [
        ordered_sum(a[i : i + rows, :, None] * b[None], dim=1) for i in range(0, a.shape[0], rows)
    ]
    return torch.cat(blocks) if blocks else a.new_zeros(0, b.shape[1])


def baseline(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    temperature: float = 1.0,
    grad_logprob: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> Reference:
    """B: what a user runs instead — logits materialized in weight's dtype (a BLAS GEMM), then
    fp32 softmax and autograd. Same arguments as `reference`, but ``hidden`` (already in weight's
    dtype) and ``weight`` stored as the implementation gets them
    (`verify.cases.layouts.with_layout`): a BLAS sums a transposed operand's dots in another order
    (an fp32 logit off by 4.8e-6 instead of 9.6e-7 at |z| 38), which B on the same storage
    shares. Results are float64.
    """
    math_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    h = hidden.detach().to(weight.dtype).requires_grad_()
    w = weight.detach().requires_grad_()
    logp_all = torch.log_softmax((h @ w.T).to(math_dtype) / temperature, dim=-1)
    logprobs, entropy, valid, _ = _per_token(
        logp_all, logp_all.exp(), targets, ignore_index, torch.sum
    )
    grad_hidden = grad_weight = None
    if grad_logprob is not None or grad_entropy is not None:
        objective = torch.zeros((), dtype=math_dtype)
        for output, upstream in ((logprobs, grad_logprob), (entropy, grad_entropy)):
            if upstream is not None:
                objective = objective + (output * upstream.to(math_dtype)).sum()
        grads = torch.autograd.grad(objective, (h, w), allow_unused=True)
        grad_hidden, grad_weight = (
            torch.zeros_like(x, dtype=torch.float64) if g is None else g.to(torch.float64)
            for g, x in zip(grads, (h, w), strict=True)
        )
    return Reference(
        logprobs.detach().double(), entropy.detach().double(), valid, grad_hidden, grad_weight
    )
