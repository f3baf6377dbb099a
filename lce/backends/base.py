"""The stages every backend implements, so one autograd function and one TP merge serve all.

A backend works on one rank's vocab shard and never materializes ``[T, V_local]`` logits at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, Protocol

import torch

from lce.options import LogitOptions


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax math and accumulation in fp32; fp64 inputs keep fp64 (exact-invariance checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class ShardStats:
    """Per-token softmax statistics of one vocab shard, all fp32 ``[T]``.

    Each lane ``j`` of the shard has a raw unit ``r_j`` (`LogitOptions`: the raw dot plus the
    bias, or with a softcap the tanh of it) and its logit centred on the shard max is
    ``z_j - max_z = k (r_j - max)``, ``k`` the `LogitOptions.centred_scale`. ``max = max_j r_j``
    in raw units (``-inf`` for an empty shard; all ranks share ``k``, so the TP MAX merge is the
    same in either unit); every lane is centred before the scale, so the max lane's value is
    exactly 0 and no lane carries a rounding at the logits' magnitude.
    ``sumexp_nonmax = sum_j exp(z_j - max_z)`` over every lane but one max lane (whose term is
    exactly 1: kept apart, ``log sumexp`` is ``log1p(sumexp_nonmax)`` and keeps its precision on
    confident rows, where ``1 + small`` would round it to eps(1)),
    ``sumexp_z = sum_j exp(z_j - max_z) * (z_j - max_z)`` (centred on the shard max, so entropy
    keeps its precision under huge common offsets), ``target_logit = r_y`` if the global target
    id ``y`` lies in ``[vocab_start, vocab_start + V_local)`` else 0, and
    ``sum_centred = sum_j (z_j - max_z)`` when the options have label smoothing (else 0). An
    empty shard gives max = -inf and zeros elsewhere.
    """

    max: torch.Tensor
    sumexp_nonmax: torch.Tensor
    sumexp_z: torch.Tensor
    target_logit: torch.Tensor
    sum_centred: torch.Tensor

    @property
    def sumexp(self) -> torch.Tensor:
        """``sum_j exp(z_j - max)`` over the whole shard (0 for an empty one)."""
        return torch.where(torch.isfinite(self.max), 1.0 + self.sumexp_nonmax, 0.0)


class TokenUpstream(NamedTuple):
    """Per-token upstream gradients on the four token statistics, ``[T]`` each: the log-prob of
    the target, the entropy, ``lse = logsumexp(z)`` and ``mean_j(-log p_j)`` (label smoothing's
    term). Zero on ignored rows."""

    logprob: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor
    smooth: torch.Tensor


@dataclass(frozen=True)
class BackwardRows:
    """Per-token fp32 ``[T]`` inputs of the backward stage, global over all shards.

    ``max`` is in raw units as in `ShardStats`; with ``c_j = k (r_j - max)`` (centred exactly as
    the forward centred it), ``log p_j = c_j - log_sumexp`` and ``z_j - E[z] = c_j -
    centred_mean``, so nothing is rounded at the logits' magnitude. Off the target lane
    ``d_z = -p * (softmax_coef + grad_entropy * (z - E[z])) + uniform``; on it ``d_z =
    target_grad``, computed per token from the statistics without cancellation (see
    `lce.tp.GlobalStats.backward_rows`). For upstreams ``g`` on the `TokenUpstream` statistics,
    ``softmax_coef = g_logprob - g_lse - g_smooth`` and ``uniform = -g_smooth / V``.
    ``softmax_coef``/``grad_entropy`` may have any stride; every field is zero on ignored rows.
    """

    max: torch.Tensor
    log_sumexp: torch.Tensor
    centred_mean: torch.Tensor
    softmax_coef: torch.Tensor
    grad_entropy: torch.Tensor
    target_grad: torch.Tensor
    uniform: torch.Tensor


class Wanted(NamedTuple):
    """Which gradients a stage computes: of ``hidden``, ``weight``, ``bias``."""

    hidden: bool
    weight: bool
    bias: bool = False


class Grads(NamedTuple):
    """A stage's gradients (None where not `Wanted`): ``hidden [T, H]`` (this shard's partial
    sum), ``weight [V_local, H]``, ``bias [V_local]`` (fp32, summed over the tokens)."""

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None = None


def select_rows(per_token: Any, rows: slice) -> Any:
    """The same `ShardStats` or `BackwardRows` for ``rows`` of the tokens only."""
    return type(per_token)(*(getattr(per_token, f.name)[rows] for f in fields(per_token)))


# (chunk stats, rows) -> the backward rows of those tokens, global over the TP group
GlobalMerge = Callable[[ShardStats, slice], BackwardRows]


class StageBackend(Protocol):
    """What a backend provides; `lce.autograd` does the rest (TP merge, masking, reduction).

    Every stage takes ``hidden [T, H]`` already in ``weight``'s dtype, ``weight [V_local, H]``,
    ``bias`` (``[V_local]`` in weight's dtype and device, or None), ``targets [T]`` int64 global
    ids (ignored rows carry -1, owned by no shard), this shard's ``vocab_start`` and the call's
    `LogitOptions`. Both backends also offer ``loss_grads_in_forward`` and ``loss_chunk_rows``
    (see `TorchChunkedStages`): stats and the gradients of a loss whose upstream gradient is
    known, in one pass over the logits (the 3-GEMM paths of `lce.linear_cross_entropy`).
    """

    def forward_stats(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
        kept: torch.Tensor | None = None,
    ) -> ShardStats:
        """Softmax statistics of the local shard. ``kept`` (``[T, V_local]`` in weight's dtype):
        the raw dots ``hidden @ weight.T`` are written there, and the statistics are those of
        the dots so rounded, for `backward_grads` to read back."""
        ...

    def backward_grads(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
        rows: BackwardRows,
        wanted: Wanted,
        grad_hidden_dtype: torch.dtype | None = None,
        kept: torch.Tensor | None = None,
        kept_writable: bool = False,
    ) -> Grads:
        """Gradients of ``sum_t`` (upstream x token statistics) for the local shard; with
        ``kept`` (`forward_stats`' dots) the logits are not recomputed. ``kept`` is read only
        (a second backward reads it again) unless ``kept_writable``: no one reads it after this
        backward, which may then write its d_logits there. The gradients are the same either way.

        ``d_z`` as `BackwardRows` spells it out, ``d_a = d_z * dz/da`` (``logit.dlogit_scale``
        times the cap's slope). Returns ``grad_hidden`` in fp32, or already in
        ``grad_hidden_dtype`` when given (rounded once from an fp32 accumulation; the caller sums
        no further), ``grad_weight`` in fp32 or already in weight's dtype (rounded likewise) and
        ``grad_bias`` in fp32 (the column sums of ``d_a`` rounded to weight's dtype, as the
        gradient GEMMs take it).
        """
        ...
