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

from lce.options import LogitOptions
from verify.numerics import portable_math

# The target id of an ignored token in every case, test and reference (lce's default).
IGNORE_INDEX = -100
PLAIN = LogitOptions()  # the plain LM head: no option set


@dataclass(frozen=True)
class Reference:
    """float64 per-token outputs ``[T]`` and the gradients of ``sum(g_lp * logprobs + g_ent *
    entropy + g_loss * token_loss)`` (``grad_bias`` None without a bias)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    token_loss: torch.Tensor  # the per-token loss of `lce.LogitOptions` (0 on ignored tokens)
    valid: torch.Tensor  # bool [T]: target not ignored
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None
    grad_bias: torch.Tensor | None = None
    # Per gradient ("grad_hidden", "grad_weight", "grad_bias"), when asked for: the sums of the
    # absolute terms of each element, which bound the rounding of any order of summing them.
    magnitudes: dict[str, torch.Tensor] | None = None
    d_logits: torch.Tensor | None = None  # [T, V] d loss / d (h W^T + b), with the magnitudes

    def loss(self, reduction: str) -> torch.Tensor:
        """``token_loss`` reduced like `lce.linear_cross_entropy` (mean over valid tokens)."""
        if reduction == "none":
            return self.token_loss
        total = self.token_loss.sum()
        return total if reduction == "sum" else total / self.valid.sum()


def loss_upstream_grad(
    valid: torch.Tensor, reduction: str, grad_loss: torch.Tensor
) -> torch.Tensor:
    """The upstream gradient on the per-token losses implied by a loss with ``reduction`` and
    ``grad_loss`` (0 on ignored tokens)."""
    if reduction != "none":
        scale = grad_loss if reduction == "sum" else grad_loss / valid.sum()
        grad_loss = scale.expand(valid.shape)
    return torch.where(valid, grad_loss, torch.zeros_like(grad_loss))


@dataclass(frozen=True)
class Upstream:
    """The upstream gradients of one reference run, each ``[T]`` or None (no gradient)."""

    logprob: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    loss: torch.Tensor | None = None

    @property
    def any(self) -> bool:
        return any(g is not None for g in (self.logprob, self.entropy, self.loss))


@dataclass(frozen=True)
class _Rows:
    """R's float64 softmax of every row: logits ``z``, ``log p``, ``p``, the log-sum-exp."""

    z: torch.Tensor
    log_p: torch.Tensor
    p: torch.Tensor
    lse: torch.Tensor


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    options: LogitOptions = PLAIN,
    ignore_index: int = IGNORE_INDEX,
    upstream: Upstream = Upstream(),
    magnitudes: bool = False,
    slope_error: float = 0.0,
) -> Reference:
    """R: float64 outputs for ``hidden [T, H]``, the *global* ``weight [V, H]`` (and ``bias
    [V]``) and ``targets [T]`` under the logit map and loss terms of ``options``.

    Gradients are computed when an upstream gradient is given, closed-form: ``d_z = g_lp (onehot -
    p) - g_ent p (log p + H) + g_loss dloss/dz`` through ``dz/da`` (`logit_map`) onto ``a = h @
    W.T + b``; ``magnitudes`` adds their absolute-term sums (`Reference.magnitudes`), each
    lane's ``dz/da`` counted as ``|dz/da| + slope_error * s / T`` (a softcap's slope computed
    in low precision is off by an absolute amount, however small the slope).
    """
    h = hidden.detach().to(weight.dtype).to(torch.float64)
    w = weight.detach().to(torch.float64)
    b = None if bias is None else bias.detach().to(torch.float64)
    raw = ordered_matmul(h, w.T)
    z, gain = logit_map(raw if b is None else raw + b, options)
    rows = _softmax_rows(z)
    logprobs, entropy, valid, safe_targets = _per_token(
        rows.log_p, rows.p, targets, ignore_index, ordered_sum
    )
    smooth = -ordered_sum(rows.log_p, dim=-1) / max(z.shape[-1], 1)
    token_loss = torch.where(valid, _token_loss(logprobs, smooth, rows.lse, options), 0.0)
    outputs = (logprobs, entropy, token_loss, valid)
    if not upstream.any:
        return Reference(*outputs, None, None)
    d_z, size = _d_logits(rows, entropy, valid, safe_targets, upstream, options)
    d_a = d_z * gain / options.temperature
    grads = {
        "grad_hidden": ordered_matmul(d_a, w),
        "grad_weight": ordered_matmul(d_a.T, h),
        "grad_bias": None if b is None else ordered_sum(d_a, dim=0),
    }
    sums = None
    if magnitudes:
        size = size * (gain.abs() + slope_error * options.logit_scale) / options.temperature
        sums = {
            "grad_hidden": ordered_matmul(size, w.abs()),
            "grad_weight": ordered_matmul(size.T, h.abs()),
        }
        if b is not None:
            sums["grad_bias"] = ordered_sum(size, dim=0)
    return Reference(*outputs, **grads, magnitudes=sums, d_logits=d_a if magnitudes else None)


def logit_map(a: torch.Tensor, options: LogitOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 logits ``z = cap * tanh(s * a / cap) / T`` (without a cap ``s * a / T``) of
    ``a = h @ W.T + b``, and ``T dz/da`` per lane: ``s`` times the cap's slope ``1 - tanh^2``
    (divided by ``T`` last, so the plain head's ``d_z / T`` keeps its bits)."""
    s, cap, temperature = options.logit_scale, options.softcap, options.temperature
    if cap is None:
        return a * s / temperature, torch.full_like(a, s)
    t, slope = portable_math.tanh_and_slope(a * s / cap)
    return cap * t / temperature, slope * s


def _softmax_rows(z: torch.Tensor) -> _Rows:
    row_max = z.amax(dim=-1, keepdim=True) if z.shape[-1] else z.new_zeros(z.shape[0], 1)
    shifted = z - row_max
    centred_lse = _centred_log_sumexp(shifted)
    log_p = shifted - centred_lse[:, None]
    return _Rows(z, log_p, portable_math.exp(log_p), row_max[:, 0] + centred_lse)


def _token_loss(
    logprobs: torch.Tensor, smooth: torch.Tensor, lse: torch.Tensor, options: LogitOptions
) -> torch.Tensor:
    """``-(1 - eps) log p_y + eps mean_j(-log p_j) + c lse**2`` (exactly ``-log p_y`` without
    either term, as lce's plain loss)."""
    eps, c = options.label_smoothing, options.z_loss
    loss = -logprobs if eps == 0 else (eps - 1.0) * logprobs + eps * smooth
    return loss + c * lse * lse if c > 0 else loss


def _d_logits(
    rows: _Rows,
    entropy: torch.Tensor,
    valid: torch.Tensor,
    targets: torch.Tensor,
    upstream: Upstream,
    options: LogitOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``d_z`` of every lane and its absolute-term size (the sum of its terms' ``|.|``: the
    smoothing term ``p - 1/V`` may cancel where neither part is small)."""
    zero = torch.zeros_like(entropy)
    g_lp, g_ent, g_loss = (
        zero if g is None else torch.where(valid, g.detach().to(torch.float64), zero)
        for g in (upstream.logprob, upstream.entropy, upstream.loss)
    )
    p, eps, c = rows.p, options.label_smoothing, options.z_loss
    onehot_minus_p = _onehot_minus_p(p, targets)
    tokens = g_lp[:, None] * onehot_minus_p - g_ent[:, None] * (p * (rows.log_p + entropy[:, None]))
    # d loss / d z = (1 - eps)(p - onehot) + eps (p - 1/V) + 2 c lse p
    inv_vocab = 1.0 / max(p.shape[-1], 1)
    lse_term = (2.0 * c * rows.lse)[:, None] * p
    loss = (eps - 1.0) * onehot_minus_p + eps * (p - inv_vocab) + lse_term
    terms = (1.0 - eps) * onehot_minus_p.abs() + eps * (p + inv_vocab) + lse_term.abs()
    # a rounded lse moves the z-loss term by 2 c p |d lse|, as rounded logits move p
    terms = terms + 2.0 * c * p
    d_z = tokens + g_loss[:, None] * loss
    return d_z, tokens.abs() + g_loss.abs()[:, None] * terms


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
    """``x.sum(dim)`` as a fixed pairwise tree of elementwise additions (same bits everywhere):
    the n terms padded with zeros to a power of two, then halves added until one is left. The
    padding is never written: the first level adds the terms it would meet to ``+0.0`` instead
    (what adding a zero does, -0.0 included), and every level adds the upper half into the lower
    one in place, along ``dim``."""
    n = x.shape[dim]
    if n <= 1:
        return x.sum(dim) if n == 0 else x.squeeze(dim).clone()
    half = 1 << (n - 1).bit_length() - 1
    acc = x.narrow(dim, 0, half).clone()
    acc.narrow(dim, 0, n - half).add_(x.narrow(dim, half, n - half))
    acc.narrow(dim, n - half, 2 * half - n).add_(0.0)
    while half > 1:
        half //= 2
        acc.narrow(dim, 0, half).add_(acc.narrow(dim, half, half))
    return acc.narrow(dim, 0, 1).squeeze(dim)


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
    bias: torch.Tensor | None = None,
    options: LogitOptions = PLAIN,
    ignore_index: int = IGNORE_INDEX,
    upstream: Upstream = Upstream(),
) -> Reference:
    """B: what a user runs instead — logits materialized in weight's dtype (a BLAS GEMM, the bias
    in its epilogue as ``F.linear`` adds it), then the logit map, softmax and loss terms in fp32,
    and autograd. Same arguments as `reference`, but ``hidden`` (already in weight's dtype) and
    ``weight`` stored as the implementation gets them (`verify.cases.layouts.with_layout`): a BLAS
    sums a transposed operand's dots in another order (an fp32 logit off by 4.8e-6 instead of
    9.6e-7 at |z| 38), which B on the same storage shares. Results are float64.
    """
    math_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    h = hidden.detach().to(weight.dtype).requires_grad_()
    w = weight.detach().requires_grad_()
    b = None if bias is None else bias.detach().requires_grad_()
    logits = h @ w.T if b is None else torch.addmm(b, h, w.T)
    z = _stock_logit_map(logits.to(math_dtype), options)
    logp_all = torch.log_softmax(z, dim=-1)
    logprobs, entropy, valid, _ = _per_token(
        logp_all, logp_all.exp(), targets, ignore_index, torch.sum
    )
    smooth = -logp_all.mean(dim=-1) if z.shape[-1] else torch.zeros_like(logprobs)
    token_loss = _token_loss(logprobs, smooth, torch.logsumexp(z, dim=-1), options)
    token_loss = torch.where(valid, token_loss, 0.0)
    leaves = (h, w) if b is None else (h, w, b)
    grads: tuple[torch.Tensor | None, ...] = (None,) * len(leaves)
    if upstream.any:
        objective = torch.zeros((), dtype=math_dtype)
        gradients = (upstream.logprob, upstream.entropy, upstream.loss)
        for output, g in zip((logprobs, entropy, token_loss), gradients, strict=True):
            if g is not None:
                objective = objective + (output * g.to(math_dtype)).sum()
        found = torch.autograd.grad(objective, leaves, allow_unused=True)
        grads = tuple(
            torch.zeros_like(x, dtype=torch.float64) if g is None else g.to(torch.float64)
            for g, x in zip(found, leaves, strict=True)
        )
    outputs = (logprobs, entropy, token_loss)
    return Reference(*(x.detach().double() for x in outputs), valid, *grads)


def _stock_logit_map(logits: torch.Tensor, options: LogitOptions) -> torch.Tensor:
    """The logit map as model code writes it (scale, ``cap * tanh(x / cap)``, ``/ T``), each
    step skipped where it is the identity."""
    if options.logit_scale != 1.0:
        logits = logits * options.logit_scale
    if options.softcap is not None:
        logits = options.softcap * torch.tanh(logits / options.softcap)
    return logits / options.temperature
