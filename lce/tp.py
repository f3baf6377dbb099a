"""Vocab-parallel tensor parallelism: the slice of the vocabulary a rank owns, and the collectives.

Forward: one MAX all-reduce of the per-token max, then one packed SUM of the shards' sums.
Backward: grad_hidden is the SUM over ranks (fp32), unless the caller reduce-scatters it itself.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from lce.backends.base import BackwardRows, ShardStats, TokenUpstream
from lce.options import LogitOptions


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of the LM head: global ids ``[vocab_start, vocab_start + vocab_local)``."""

    group: dist.ProcessGroup | None
    vocab_start: int
    vocab_local: int

    def owns(self, targets: torch.Tensor) -> torch.Tensor:
        """bool per target: its global id lies in this shard."""
        local = targets - self.vocab_start
        return (local >= 0) & (local < self.vocab_local)


def usable_group(tp_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``tp_group``, or None where it holds one rank (no TP)."""
    if tp_group is None:
        return None
    if not dist.is_initialized():
        raise ValueError("tp_group was given but torch.distributed is not initialized")
    return None if dist.get_world_size(tp_group) == 1 else tp_group


def resolve_shard(
    group: dist.ProcessGroup | None, vocab_start: int | None, vocab_local: int
) -> VocabShard:
    """Shard of the calling rank; ``vocab_start`` defaults to ``tp_rank * vocab_local``.

    ``group`` is a `usable_group` whose ranks passed `agree_on_call`.
    """
    if vocab_start is None:
        vocab_start = 0 if group is None else dist.get_rank(group) * vocab_local
    return VocabShard(group, int(vocab_start), vocab_local)


@dataclass(frozen=True)
class CallShape:
    """What every rank of a TP group must agree on before the per-token collectives."""

    num_tokens: int
    vocab_local: int
    vocab_start_given: bool
    logit_key: int  # `logit_key` of the call's logit options


def logit_key(logit: LogitOptions) -> int:
    """A 32-bit digest of ``logit``'s fields, equal on ranks that passed equal options."""
    return zlib.crc32(json.dumps(asdict(logit), sort_keys=True).encode())


def agree_on_call(
    group: dist.ProcessGroup, shape: CallShape | None, local_error: Exception | None
) -> int:
    """Raise the same error on every rank of ``group`` unless all ranks can run the call; return
    the group's largest ``vocab_local`` (for choices every rank must make alike).

    One MAX all-reduce of nine ints, before any collective whose size depends on the tokens
    (ranks that disagree there end in a collective mismatch or a hang). ``shape`` is None and
    ``local_error`` set where this rank's own arguments were rejected: that rank raises its error,
    the others say which went wrong.
    """
    failed = shape is None or local_error is not None
    tokens, vocab, given, key = (0, 0, 0, 0) if shape is None else (
        shape.num_tokens, shape.vocab_local, int(shape.vocab_start_given), shape.logit_key
    )  # fmt: skip
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    packed = torch.tensor(
        [tokens, -tokens, vocab, -vocab, given, -given, key, -key, int(failed)],
        dtype=torch.int64,
        device=device,
    )
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    (
        most_tokens, fewest_tokens, most_vocab, fewest_vocab, any_given, not_all_given,
        top_key, bottom_key, any_failed,
    ) = packed.tolist()  # fmt: skip
    if local_error is not None:
        raise local_error
    if any_failed:
        raise ValueError(
            "another rank of the TP group rejected its arguments (its error says why); every rank "
            "must pass valid arguments to the same call"
        )
    if most_tokens != -fewest_tokens:
        raise ValueError(
            f"the ranks of the TP group passed different token counts ({-fewest_tokens}.."
            f"{most_tokens}); vocab-parallel lce needs the same hidden rows and targets on every "
            "rank of tp_group (only the weight is split by vocabulary)"
        )
    if top_key != -bottom_key:
        raise ValueError(
            "the ranks of the TP group passed different logit options (temperature and the "
            "other options of the logit map and loss); pass the same values on every rank"
        )
    if any_given and not_all_given == 0:  # max(-given) = 0: some rank gave none
        raise ValueError(
            "only some ranks of the TP group passed vocab_start; pass it on every rank (each its "
            "own first global id) or on none (equal shards, vocab_start = tp_rank * V_local)"
        )
    if not any_given and most_vocab != -fewest_vocab:
        raise ValueError(
            f"vocab shards of the TP group have different sizes ({-fewest_vocab}..{most_vocab} "
            "rows), so the default vocab_start = tp_rank * V_local is wrong; pass vocab_start "
            "(this rank's first global id) explicitly"
        )
    return most_vocab


@dataclass(frozen=True)
class GlobalStats:
    """Per-token fp32 ``[T]`` softmax statistics over the whole vocabulary.

    Every field is relative to the row max m, so nothing is rounded at the logits' magnitude;
    ``log_sumexp`` is ``log1p`` of the non-max terms, so a confident row's ``log p_y`` and
    ``1 - p_y = -expm1(log p_y)`` keep their relative precision (no ``1 - p`` cancellation).
    """

    max: torch.Tensor  # the row max over all shards in raw units (`ShardStats`); m = k * max
    log_sumexp: torch.Tensor  # log sum_j exp(z_j - m): lse = m + log_sumexp, never rounded whole
    target_centred: torch.Tensor  # z_y - m = k (r_y - max): exactly 0 when y is the max
    centred_mean: torch.Tensor  # E_p[z] - m
    owners: torch.Tensor  # how many shards hold the target id: 1 if valid, 0 if outside [0, V)
    max_logit: torch.Tensor  # m = k * max, the row max in logit units
    mean_centred: torch.Tensor  # mean_j (z_j - m) over the whole vocabulary (label smoothing; 0)
    inv_vocab: torch.Tensor  # 1 / V, V the whole vocabulary's size (label smoothing; else 0)

    @property
    def entropy(self) -> torch.Tensor:
        """``lse - E_p[z]``, both centred on m."""
        return self.log_sumexp - self.centred_mean

    @property
    def logprob(self) -> torch.Tensor:
        """``z_y - lse = (z_y - m) - log_sumexp``: exactly ``-log_sumexp`` when y is the max."""
        return self.target_centred - self.log_sumexp

    @property
    def lse(self) -> torch.Tensor:
        """``logsumexp_j z_j = m + log_sumexp`` (the z-loss's term), rounded once at its size."""
        return self.max_logit + self.log_sumexp

    @property
    def smooth(self) -> torch.Tensor:
        """``mean_j(-log p_j) = log_sumexp - mean_j (z_j - m)``: two terms >= 0, no cancellation
        (label smoothing's term; meaningless without it)."""
        return self.log_sumexp - self.mean_centred

    @property
    def target_complement(self) -> torch.Tensor:
        """``1 - p_y`` as ``-expm1(log p_y)``: relative precision however close p_y is to 1."""
        return -torch.expm1(self.logprob)

    def backward_rows(self, upstream: TokenUpstream) -> BackwardRows:
        """The backward's rows for ``upstream`` gradients on the token statistics.

        ``d_z_j = g_lp (onehot_j - p_j) - g_ent p_j (z_j - E[z]) + g_lse p_j + g_sm (p_j - 1/V)``;
        on the target lane ``g_lp (1 - p_y)`` uses the uncancelled complement.
        """
        p_target = torch.exp(self.logprob)
        spread = self.target_centred - self.centred_mean
        uniform = -upstream.smooth * self.inv_vocab
        target_grad = (
            upstream.logprob * self.target_complement
            - upstream.entropy * p_target * spread
            + (upstream.lse + upstream.smooth) * p_target
            + uniform
        )
        return BackwardRows(
            max=self.max,
            log_sumexp=self.log_sumexp,
            centred_mean=self.centred_mean,
            softmax_coef=upstream.logprob - upstream.lse - upstream.smooth,
            grad_entropy=upstream.entropy,
            target_grad=target_grad,
            uniform=uniform,
        )


def merge_stats(
    stats: ShardStats, target_owned: torch.Tensor, shard: VocabShard, logit: LogitOptions
) -> GlobalStats:
    """Combine each rank's shard stats: one MAX all-reduce, then one packed SUM all-reduce.

    ``target_owned`` is a bool ``[T]``: this rank's shard holds the token's target id. The raw
    maxima are subtracted before the scale (``logit.centred_scale``), as the kernels centre each
    lane. With label smoothing the packed sum also carries each shard's centred sum of the logits
    and its size, so the mean is over the whole (global) vocabulary.
    """
    k, group = logit.centred_scale, shard.group
    global_max = stats.max.clone()
    if group is not None:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    # A rank whose shard is empty (or whose row is all -inf) has max = -inf: it must add exactly 0.
    owned = torch.isfinite(stats.max)
    zero = torch.zeros_like(global_max)
    shift = torch.where(owned, (stats.max - global_max) * k, zero)
    scale = torch.where(owned, torch.exp(shift), zero)
    # Re-centre sum exp(z - m_r) (z - m_r) on the global max M: add (m_r - M) * sumexp.
    sumexp_z = scale * (stats.sumexp_z + shift * stats.sumexp)
    # The non-max terms over all ranks: each rank's own, plus its max lane's term unless that lane
    # is the global max; of the ``holds_max`` ranks at M, all but one add their 1 after the sum.
    holds_max = owned & (stats.max == global_max)
    nonmax = scale * stats.sumexp_nonmax + torch.where(holds_max, zero, scale)
    sums = [nonmax, holds_max.to(nonmax.dtype), sumexp_z, stats.target_logit, target_owned.to(zero)]
    smoothing = logit.label_smoothing > 0
    if smoothing:  # sum_j (z_j - M) = sum_j (z_j - m_r) + V_r (m_r - M), and V = sum_r V_r
        sums += [torch.where(owned, stats.sum_centred + shard.vocab_local * shift, zero)]
        sums += [torch.full_like(zero, shard.vocab_local)]
    packed = torch.stack(sums)
    if group is not None:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    nonmax, max_holders, sumexp_z, target_logit, owners, *vocab_sums = packed.unbind(0)
    nonmax = nonmax + (max_holders - 1.0)  # exact: 0 unless ranks tie at the max
    mean_centred, inv_vocab = zero, zero
    if smoothing:
        inv_vocab = 1.0 / vocab_sums[1]
        mean_centred = vocab_sums[0] * inv_vocab
    return GlobalStats(
        max=global_max,
        log_sumexp=torch.log1p(nonmax),
        target_centred=(target_logit - global_max) * k,
        centred_mean=sumexp_z / (1.0 + nonmax),
        owners=owners,
        max_logit=global_max * k,
        mean_centred=mean_centred,
        inv_vocab=inv_vocab,
    )


def reduce_grad_hidden(grad_hidden: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum the per-rank partial ``grad_hidden`` (fp32) over the TP group, in place."""
    if group is not None:
        dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=group)
    return grad_hidden
