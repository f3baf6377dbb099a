"""Third-party linear cross-entropy kernels, each written the way peers write them, each with one
real bug class: the harness's detection power measured on code it has never seen.

Each kernel is a plain loss function (``--impl bug_zoo:NAME``: its keyword parameters say what it
claims) or an adapter factory, CPU-runnable PyTorch standing in for a GPU kernel's tiling. The
docstring's first line names the bug; the rest says where the class was seen and which inputs
reveal it. `benchmarks/zoo_campaigns.py` runs the ci profile against each and prints a table.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F

from verify.adapters.interface import Adapter, Call, Capabilities, NumericalContract

# --- tiling bugs: only inputs past a tile boundary reveal them -----------------------------------


def vocab_tiles_stale_sum(hidden, weight, targets, *, reduction="mean", ignore_index=-100):
    """Online logsumexp over 256-wide vocab tiles that keeps the running sum when the max grows.

    The flash-attention rescale ``sum *= exp(old_max - new_max)`` forgotten: right while the first
    tile holds each row's max, wrong once a later tile beats it (V > 256)."""
    logits = (hidden @ weight.T).float()
    run_max = torch.full_like(logits[:, 0], -torch.inf)
    run_sum = torch.zeros_like(run_max)
    for tile in logits.split(256, dim=1):
        run_max = torch.maximum(run_max, tile.amax(1))
        run_sum = run_sum + (tile - run_max[:, None]).exp().sum(1)
    return _nll(run_max + run_sum.log(), logits, targets, reduction, ignore_index)


def token_tail_dropped(hidden, weight, targets, *, reduction="mean", ignore_index=-100):
    """Token chunks of 512 whose count is ``T // 512``: the tail chunk is never computed.

    An off-by-one in a chunk count (verl's FusedLinearForPPO chunks 512 tokens); a batch of at
    most 512 tokens takes the one-chunk path and is right."""
    rows = hidden.shape[0]
    count = rows // 512 if rows > 512 else 1
    losses = hidden.new_zeros(rows, dtype=torch.float32)
    valid = targets != ignore_index
    for index in range(count):
        part = slice(index * 512, min(rows, (index + 1) * 512) if count == 1 else (index + 1) * 512)
        logits = (hidden[part] @ weight.T).float()
        safe = torch.where(valid[part], targets[part], 0)
        nll = logits.logsumexp(1) - logits.gather(1, safe[:, None]).squeeze(1)
        losses[part] = torch.where(valid[part], nll, 0.0)
    return _reduce(losses, valid, reduction)


def vocab_tail_padded(hidden, weight, targets, *, reduction="mean", ignore_index=-100):
    """Vocab chunks of 4096 with the last chunk zero-padded to full width (static shapes), the
    padding's logits left at 0 instead of -inf: every row's logsumexp gains ``exp(0)`` terms.

    Large-vocabulary chunking (Unsloth chunks 65536 ids); one chunk when V <= 4096."""
    logits = (hidden @ weight.T).float()
    vocab = logits.shape[1]
    if vocab > 4096:
        logits = F.pad(logits, (0, -vocab % 4096))
    lse = torch.cat([c.logsumexp(1, keepdim=True) for c in logits.split(4096, 1)], 1).logsumexp(1)
    return _nll(lse, logits, targets, reduction, ignore_index)


def target_tile_unmasked(hidden, weight, targets, *, reduction="mean", ignore_index=-100):
    """The target's logit gathered tile by tile (1024 ids a tile) with only ``local < width``
    checked: tiles before the target's add their first logit again (``local >= 0`` missing).

    A CCE-style indexed dot split over vocab tiles; right while V <= 1024 (one tile)."""
    logits = (hidden @ weight.T).float()
    valid = targets != ignore_index
    target_logit = torch.zeros_like(logits[:, 0])
    for start in range(0, logits.shape[1], 1024):
        tile = logits[:, start : start + 1024]
        local = targets - start
        hit = valid & (local < tile.shape[1])
        picked = tile.gather(1, local.clamp(0, tile.shape[1] - 1)[:, None]).squeeze(1)
        target_logit = target_logit + torch.where(hit, picked, 0.0)
    losses = torch.where(valid, logits.logsumexp(1) - target_logit, 0.0)
    return _reduce(losses, valid, reduction)


def hidden_tail_split_k(hidden, weight, targets, *, reduction="mean", ignore_index=-100):
    """A split-K product over 256-wide hidden tiles whose loop stops at the last whole tile: the
    remainder of H is never multiplied in (``range(0, H - 255, 256)``).

    Split-K reductions of tile-based kernels; H <= 256 takes the one-tile path."""
    size = hidden.shape[1]
    if size <= 256:
        logits = (hidden @ weight.T).float()
    else:
        logits = sum(
            (hidden[:, k : k + 256] @ weight[:, k : k + 256].T).float()
            for k in range(0, size - 255, 256)
        )
    return _nll(logits.logsumexp(1), logits, targets, reduction, ignore_index)


# --- reduction and masking bugs ------------------------------------------------------------------


def chunk_means_averaged(hidden, weight, targets, *, reduction="mean", ignore_index=-100):
    """The mean loss as the mean of 8-token chunks' means: chunks with fewer valid tokens weigh
    more (transformers' gradient-accumulation loss, 2024)."""
    valid = targets != ignore_index
    logits = (hidden @ weight.T).float()
    safe = torch.where(valid, targets, 0)
    losses = torch.where(valid, logits.logsumexp(1) - logits.gather(1, safe[:, None])[:, 0], 0.0)
    if reduction != "mean":
        return _reduce(losses, valid, reduction)
    means = [
        part.sum() / keep.sum() for part, keep in zip(losses.split(8), valid.split(8), strict=True)
    ]
    return torch.stack(means).nanmean() if means else losses.sum() / 0


def ignore_negative_only(hidden, weight, targets, *, reduction="mean", ignore_index=-100):
    """Ignored tokens found as ``targets < 0``: an ignore index inside the vocabulary (a pad id,
    0) is trained on, and -100 works."""
    valid = targets >= 0
    logits = (hidden @ weight.T).float()
    safe = torch.where(valid, targets, 0)
    losses = torch.where(valid, logits.logsumexp(1) - logits.gather(1, safe[:, None])[:, 0], 0.0)
    return _reduce(losses, valid, reduction)


def strided_rows_assumed(hidden, weight, targets, *, reduction="mean", ignore_index=-100):
    """Rows read as ``as_strided(shape, (H, 1))``: a kernel that passes ``data_ptr`` and assumes a
    contiguous row-major hidden reads the wrong numbers from a sliced or transposed view."""
    packed = hidden.as_strided(hidden.shape, (hidden.shape[1], 1))
    logits = (packed @ weight.T).float()
    return _nll(logits.logsumexp(1), logits, targets, reduction, ignore_index)


# --- backward bugs ------------------------------------------------------------------------------


class _PrecomputedGrads(torch.autograd.Function):
    """The mean or summed loss with its gradients formed in the forward (upstream assumed 1) and
    scaled in the backward: the 3-GEMM trick of fused kernels (Liger, CCE's filter path).
    grad_weight is summed over ``chunk``-token chunks in ``accumulate_dtype``."""

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, ignore_index, mean, chunk, accumulate_dtype, scale_gw
    ):
        valid = targets != ignore_index
        count = valid.sum()
        scale = 1.0 / count.clamp_min(1) if mean else 1.0  # no token: NaN loss, zero gradients
        losses = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=accumulate_dtype)
        for rows in torch.arange(hidden.shape[0]).split(chunk):
            logits = (hidden[rows] @ weight.T).float()
            safe = torch.where(valid[rows], targets[rows], 0)
            nll = logits.logsumexp(1) - logits.gather(1, safe[:, None])[:, 0]
            losses[rows] = torch.where(valid[rows], nll, 0.0)
            d_logits = logits.softmax(1) - F.one_hot(safe, logits.shape[1])
            d_logits = (d_logits * valid[rows, None] * scale).to(weight.dtype)
            grad_hidden[rows] = (d_logits @ weight).to(hidden.dtype)
            grad_weight += (d_logits.T @ hidden[rows]).to(accumulate_dtype)
        ctx.scale_gw = scale_gw
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return losses.sum() / count if mean else losses.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        if ctx.scale_gw:
            grad_weight = grad_weight * grad_loss
        return grad_hidden * grad_loss, grad_weight, None, None, None, None, None, None


def _precomputed(hidden, weight, targets, reduction, ignore_index, *grads_config):
    if reduction == "none":  # per-token upstreams: the plain autograd path
        logits = (hidden @ weight.T).float()
        return _nll(logits.logsumexp(1), logits, targets, reduction, ignore_index)
    mean = reduction == "mean"
    return _PrecomputedGrads.apply(hidden, weight, targets, ignore_index, mean, *grads_config)


def grad_weight_unscaled(hidden, weight, targets, *, reduction="mean", ignore_index=-100):
    """Gradients formed in the forward; the backward scales grad_hidden by the loss's upstream
    but not grad_weight (Liger's fused linear cross-entropy before its fix): right for an
    upstream of 1, the usual test's."""
    args = (4, torch.float32, False)
    return _precomputed(hidden, weight, targets, reduction, ignore_index, *args)


def grad_weight_low_precision_sum(hidden, weight, targets, *, reduction="mean", ignore_index=-100):
    """grad_weight summed over 2-token chunks in the weight's dtype: one bf16 rounding per chunk
    (a ``zeros_like(weight)`` accumulator with ``addmm_``), growing with the chunk count."""
    args = (2, weight.dtype, True)
    return _precomputed(hidden, weight, targets, reduction, ignore_index, *args)


# --- model options -------------------------------------------------------------------------------


def softcap_ignored(hidden, weight, targets, *, reduction="mean", ignore_index=-100, softcap=None):
    """Takes ``softcap`` and never applies it: the Gemma 2 cap silently skipped (CCE #48, verl PR
    #7991)."""
    logits = (hidden @ weight.T).float()
    return _nll(logits.logsumexp(1), logits, targets, reduction, ignore_index)


def softcap_slope_missing(
    hidden, weight, targets, *, reduction="mean", ignore_index=-100, softcap=None
):
    """The cap applied in the forward, its tanh's slope left out of the backward (the capped
    logits' gradient passed straight through to the raw logits)."""
    logits = (hidden @ weight.T).float()
    if softcap is not None:
        capped = softcap * torch.tanh(logits / softcap)
        logits = logits + (capped - logits).detach()
    return _nll(logits.logsumexp(1), logits, targets, reduction, ignore_index)


def smoothing_counts_ignored(
    hidden, weight, targets, *, reduction="mean", ignore_index=-100, label_smoothing=0.0
):
    """Label smoothing's uniform term summed over ignored tokens too (PyTorch's cross_entropy
    before 1.10 with ``ignore_index``)."""
    valid = targets != ignore_index
    logits = (hidden @ weight.T).float()
    logp = logits.log_softmax(1)
    safe = torch.where(valid, targets, 0)
    nll = torch.where(valid, -logp.gather(1, safe[:, None])[:, 0], 0.0)
    smooth = -logp.mean(1)
    losses = (1 - label_smoothing) * nll + label_smoothing * smooth
    return _reduce(losses, valid, reduction)


def z_loss_detached(hidden, weight, targets, *, reduction="mean", ignore_index=-100, z_loss=0.0):
    """The z-loss ``c * lse^2`` added with a detached logsumexp: the loss value is right, its
    gradient is not (the term's gradient ``2 c lse p`` missing)."""
    logits = (hidden @ weight.T).float()
    lse = logits.logsumexp(1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    losses = lse - logits.gather(1, safe[:, None])[:, 0] + z_loss * lse.detach() ** 2
    return _reduce(torch.where(valid, losses, 0.0), valid, reduction)


# --- per-token kernels (RL): adapters ------------------------------------------------------------


def _token_adapter(name: str, token_fn, **capabilities) -> Adapter:
    def outputs(call: Call) -> dict[str, torch.Tensor]:
        hidden = call.hidden.to(call.weight.dtype).reshape(-1, call.hidden.shape[-1])
        logprobs, entropy = token_fn(hidden, call.weight, call.targets.reshape(-1), call)
        return {
            "logprobs": logprobs.view(call.targets.shape),
            "entropy": entropy.view(call.targets.shape),
        }

    return Adapter(
        name, ("logprobs", "entropy"), outputs,
        capabilities=Capabilities(**capabilities),
        contract=NumericalContract(logits="fp32", outputs="fp32"),
        description=f"bug_zoo.{name}",
    )  # fmt: skip


def _entropy_from_probs(hidden, weight, targets, call):
    logits = (hidden @ weight.T).float() / call.temperature
    valid = targets != call.ignore_index
    probs = logits.softmax(1)
    logp = probs.log()
    token = logp.gather(1, torch.where(valid, targets, 0)[:, None])[:, 0]
    entropy = -(probs * logp).sum(1)
    return torch.where(valid, token, 0.0), torch.where(valid, entropy, 0.0)


def entropy_from_probs() -> Adapter:
    """Entropy as ``-(p * log p).sum()`` with ``log p = log(softmax)``: an underflowed ``p = 0``
    gives ``0 * -inf = NaN`` on wide rows (the RL trainers' entropy NaNs)."""
    return _token_adapter("entropy_from_probs", _entropy_from_probs, options=("temperature",))


def _untempered_entropy(hidden, weight, targets, call):
    raw = (hidden @ weight.T).float()
    valid = targets != call.ignore_index
    logp = (raw / call.temperature).log_softmax(1)
    token = logp.gather(1, torch.where(valid, targets, 0)[:, None])[:, 0]
    entropy = raw.logsumexp(1) - (raw.softmax(1) * raw).sum(1)
    return torch.where(valid, token, 0.0), torch.where(valid, entropy, 0.0)


def entropy_untempered() -> Adapter:
    """Log-probs at the sampling temperature, entropy of the raw logits (temperature applied to
    one output of two)."""
    return _token_adapter("entropy_untempered", _untempered_entropy, options=("temperature",))


def _shard_lse_only(hidden, weight, targets, call):
    logits = _replicated(hidden.float(), call) @ weight.float().T
    rank = dist.get_rank(call.tp_group) if call.tp_group is not None else 0
    start = call.vocab_start if call.vocab_start is not None else rank * weight.shape[0]
    local = targets - start
    owned = (local >= 0) & (local < weight.shape[0]) & (targets != call.ignore_index)
    lse = logits.logsumexp(1)  # the bug: never all-reduced over the shards
    picked = logits.gather(1, local.clamp(0, max(weight.shape[0] - 1, 0))[:, None])[:, 0]
    logprobs = torch.where(owned, picked - lse, 0.0)
    entropy = torch.where(owned, lse - (logits.softmax(1) * logits).sum(1), 0.0)
    return _summed(logprobs, call.tp_group), _summed(entropy, call.tp_group)


def tp_local_logsumexp() -> Adapter:
    """Vocab-parallel log-probs normalized by the target's own shard (the logsumexp never
    all-reduced): exact at TP 1, wrong at TP >= 2."""
    return _token_adapter("tp_local_logsumexp", _shard_lse_only, tensor_parallel=True)


# --- the clean twins: what a failure must pass on to count as the bug's ------------------------


def clean(
    hidden, weight, targets, *, reduction="mean", ignore_index=-100, softcap=None,
    label_smoothing=0.0, z_loss=0.0,
):  # fmt: skip
    """The materialized loss, right (fp32 logits, PyTorch's cross-entropy and label smoothing)."""
    logits = (hidden @ weight.T).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    losses = F.cross_entropy(
        logits, targets, reduction="none", ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )  # fmt: skip
    valid = targets != ignore_index
    if z_loss:
        losses = losses + torch.where(valid, z_loss * logits.logsumexp(1) ** 2, 0.0)
    return _reduce(losses, valid, reduction)


def _clean_tokens(hidden, weight, targets, call):
    logits = (hidden @ weight.T).float() / call.temperature
    valid = targets != call.ignore_index
    logp = logits.log_softmax(1)
    token = logp.gather(1, torch.where(valid, targets, 0)[:, None])[:, 0]
    entropy = logits.logsumexp(1) - (logp.exp() * logits).sum(1)
    return torch.where(valid, token, 0.0), torch.where(valid, entropy, 0.0)


def clean_tokens() -> Adapter:
    """Per-token log-probs and entropy, right."""
    return _token_adapter("clean_tokens", _clean_tokens, options=("temperature",))


def _clean_tp_tokens(hidden, weight, targets, call):
    group = call.tp_group
    logits = _replicated(hidden.float(), call) @ weight.float().T
    rank = dist.get_rank(group) if group is not None else 0
    start = call.vocab_start if call.vocab_start is not None else rank * weight.shape[0]
    local = targets - start
    owned = (local >= 0) & (local < weight.shape[0]) & (targets != call.ignore_index)
    row_max = F.pad(logits.detach(), (0, 1), value=-1e30).amax(1)
    if group is not None:
        dist.all_reduce(row_max, dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max[:, None]
    total, weighted = shifted.exp().sum(1), (shifted.exp() * shifted).sum(1)
    picked = shifted.gather(1, local.clamp(0, max(weight.shape[0] - 1, 0))[:, None])[:, 0]
    total, weighted, picked = (
        _summed(value, group) for value in (total, weighted, torch.where(owned, picked, 0.0))
    )
    valid = targets != call.ignore_index
    logprobs = torch.where(valid, picked - total.log(), 0.0)
    entropy = torch.where(valid, total.log() - weighted / total, 0.0)
    return logprobs, entropy


def clean_tp_tokens() -> Adapter:
    """Vocab-parallel per-token log-probs and entropy, right."""
    return _token_adapter("clean_tp_tokens", _clean_tp_tokens, tensor_parallel=True)


# --- shared tails -------------------------------------------------------------------------------


class _SumOverRanks(torch.autograd.Function):
    """Megatron's reduce-from-TP-region: all-reduce forward, identity backward (each rank's
    outputs are the same replicated value)."""

    @staticmethod
    def forward(ctx, value, group):
        value = value.clone()
        dist.all_reduce(value, group=group)
        return value

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToRanks(torch.autograd.Function):
    """Megatron's copy-to-TP-region: identity forward, gradient all-reduced backward (hidden is
    replicated, each rank's partial gradient summed)."""

    @staticmethod
    def forward(ctx, value, group):
        ctx.group = group
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _summed(value, group):
    return value if group is None else _SumOverRanks.apply(value, group)


def _replicated(hidden, call):
    """``hidden`` whose gradient sums the ranks' (when the call asks for a reduced one); pass it
    in fp32, so the partial gradients are summed before they are rounded."""
    if call.tp_group is None or not call.reduce_grad_hidden:
        return hidden
    return _CopyToRanks.apply(hidden, call.tp_group)


def _nll(lse, logits, targets, reduction, ignore_index):
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    losses = torch.where(valid, lse - logits.gather(1, safe[:, None])[:, 0], 0.0)
    return _reduce(losses, valid, reduction)


def _reduce(losses, valid, reduction):
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum()


# Each kernel and its clean twin (what a finding must pass on to count as the kernel's bug).
ZOO = {
    **dict.fromkeys(
        (
            "vocab_tiles_stale_sum",
            "token_tail_dropped",
            "vocab_tail_padded",
            "target_tile_unmasked",
            "hidden_tail_split_k",
            "chunk_means_averaged",
            "ignore_negative_only",
            "strided_rows_assumed",
            "grad_weight_unscaled",
            "grad_weight_low_precision_sum",
            "softcap_ignored",
            "softcap_slope_missing",
            "smoothing_counts_ignored",
            "z_loss_detached",
        ),
        "clean",
    ),
    "entropy_from_probs": "clean_tokens",
    "entropy_untempered": "clean_tokens",
    "tp_local_logsumexp": "clean_tp_tokens",
}
