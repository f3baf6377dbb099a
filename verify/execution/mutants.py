"""Planted bugs ("mutants") for the engine's self-test: each a real bug class, applied at run time.

`applied(name)` patches lce for the duration of a ``with`` block (in the driver at TP = 1, in each
worker at TP > 1: the pool job applies it from the payload). Most mutants wrap the backend's stages
(`MutantStages`), so they work on both backends; the rest patch one function of lce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from unittest import mock

import torch

import lce
import lce.api
import lce.autograd
import lce.backends.torch_chunked as torch_chunked
import lce.dtensor
import lce.grad_buffer
import lce.loss_pass
import lce.loss_terms
import lce.plan
import lce.tp
from lce.backends.base import Grads, ShardStats, select_rows
from lce.options import LogitOptions

PAD_LANES = 16  # padded-lanes mutant: shards padded to a multiple of this many vocab lanes
WRAP_LIMIT = 1 << 9  # int32-wrap mutant: offsets row * V_local wrap at 2^9 instead of 2^31
BUGGY_CHUNK = 2  # bf16-accumulation mutant: tokens per chunk


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # the real bug class, one line
    patch: Callable[[], contextlib.AbstractContextManager]
    backends: tuple[str, ...] = ("torch", "triton")  # where the patched code runs
    min_tp: int = 1  # the smallest TP degree at which the bug changes anything

    def applies_to(self, backend: str | None) -> bool:
        """Whether planting this mutant changes ``backend`` (None: the spec's own, any)."""
        return backend is None or backend in self.backends


class MutantStages:
    """Wraps a StageBackend; subclasses bend its statistics or gradients like a real bug would."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        # The double-backward recomputation is not bent (no mutant plants a bug there), nor is
        # the 3-GEMM loss pass's chunk sizing (its stages run unbent, `loss_grads_in_forward`);
        # the scalar-loss fast path stays hidden, so the default loss runs through the bent stages.
        if name in ("stats_with_graph", "loss_chunk_rows"):
            return getattr(self.inner, name)
        raise AttributeError(name)

    def forward_stats(self, hidden, weight, bias, targets, vocab_start, logit, *kept):
        stats = self.inner.forward_stats(hidden, weight, bias, targets, vocab_start, logit, *kept)
        return self.bend_stats(stats, weight.shape[0], logit)

    def bend_stats(self, stats: ShardStats, vocab_local: int, logit) -> ShardStats:
        return stats

    def backward_grads(self, hidden, weight, bias, targets, vocab_start, logit, *rest, **kw):
        return self.inner.backward_grads(
            hidden, weight, bias, targets, vocab_start, logit, *rest, **kw
        )

    def loss_grads_in_forward(self, *args):
        # The planted bugs bend the two 4-GEMM stages; the 3-GEMM loss paths run unbent.
        return self.inner.loss_grads_in_forward(*args)


def _recentre(stats: ShardStats, new_max: torch.Tensor, logit) -> ShardStats:
    """``stats`` re-centred on ``new_max`` (raw units, as `ShardStats.max`) in their own dtype
    (so lanes underflow exactly as a kernel computing ``exp(k (r - new_max))`` would)."""
    shift = (stats.max - new_max) * logit.centred_scale
    scale = torch.exp(shift)
    return replace(
        stats,
        max=new_max,
        # No lane sits at new_max: the whole (underflowing) sum, less the 1 lce adds back.
        sumexp_nonmax=stats.sumexp * scale - 1.0,
        sumexp_z=scale * (stats.sumexp_z + shift * stats.sumexp),
    )


class MaxStartsAtZero(MutantStages):
    def bend_stats(self, stats, vocab_local, logit):
        return _recentre(stats, stats.max.clamp_min(0.0), logit)


class PaddedLanesZero(MutantStages):
    def bend_stats(self, stats, vocab_local, logit):
        pad = -vocab_local % PAD_LANES
        if pad == 0:
            return stats
        # pad lanes hold logit 0, not -inf
        stats = _recentre(stats, stats.max.clamp_min(0.0), logit)
        centred = -stats.max * logit.centred_scale  # a pad lane's z - max z
        lanes = pad * torch.exp(centred)
        return replace(
            stats,
            sumexp_nonmax=stats.sumexp_nonmax + lanes,
            sumexp_z=stats.sumexp_z + lanes * centred,
        )


class EntropyWithoutTemperature(MutantStages):
    def bend_stats(self, stats, vocab_local, logit):
        # sum exp(z - m) (z - m) taken over raw logits: every centred logit is T times too big.
        return replace(stats, sumexp_z=stats.sumexp_z * logit.temperature)


def _rows(fn):
    """Backward mutants: call ``fn(grad_logprob, grad_entropy, targets, vocab_start, vocab_local)``
    to bend the upstream gradients before the real backward."""

    class Bent(MutantStages):
        def backward_grads(
            self, hidden, weight, bias, targets, vocab_start, logit, rows, *need, **kw
        ):
            g_lp, g_ent = fn(
                rows.softmax_coef, rows.grad_entropy, targets, vocab_start, weight.shape[0]
            )
            bent = replace(rows, softmax_coef=g_lp, grad_entropy=g_ent)
            return self.inner.backward_grads(
                hidden, weight, bias, targets, vocab_start, logit, bent, *need, **kw
            )

    return Bent


def _first_row_only(g_lp, g_ent, targets, vocab_start, vocab_local):
    return g_lp[:1].expand_as(g_lp), g_ent[:1].expand_as(g_ent)


def _zero_foreign_rows(g_lp, g_ent, targets, vocab_start, vocab_local):
    local = targets - vocab_start
    owned = (local >= 0) & (local < vocab_local)
    return torch.where(owned, g_lp, 0.0), torch.where(owned, g_ent, 0.0)


class Int32Wrap(MutantStages):
    """Row offsets ``row * V_local`` wrap at `WRAP_LIMIT`: late rows read an early row's hidden."""

    @staticmethod
    def _wrapped(hidden: torch.Tensor, vocab_local: int) -> torch.Tensor:
        rows = torch.arange(hidden.shape[0]) * max(vocab_local, 1) % WRAP_LIMIT
        return hidden[rows // max(vocab_local, 1)]

    def forward_stats(self, hidden, weight, *args):
        return super().forward_stats(self._wrapped(hidden, weight.shape[0]), weight, *args)

    def backward_grads(self, hidden, weight, *args, **kw):
        return super().backward_grads(self._wrapped(hidden, weight.shape[0]), weight, *args, **kw)


class Bf16GradWeight(MutantStages):
    """grad_weight accumulated chunk by chunk in a bf16 buffer."""

    def backward_grads(
        self, hidden, weight, bias, targets, vocab_start, logit, rows, wanted, *dt, **kw
    ):
        grad_hidden_dtype, *kept = dt or (None,)  # kept logits: cut into the same chunks
        device = hidden.device
        grad_hidden = (
            torch.zeros(hidden.shape, dtype=torch.float32, device=device) if wanted.hidden else None
        )
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.bfloat16, device=device)
            if wanted.weight
            else None
        )
        grad_bias = torch.zeros(weight.shape[0], device=device) if wanted.bias else None
        for start in range(0, hidden.shape[0], BUGGY_CHUNK):
            r = slice(start, start + BUGGY_CHUNK)
            gh, gw, gb = self.inner.backward_grads(
                hidden[r], weight, bias, targets[r], vocab_start, logit,
                select_rows(rows, r), wanted, grad_hidden_dtype, *(k[r] for k in kept), **kw,
            )  # fmt: skip
            if gh is not None:
                grad_hidden = grad_hidden.to(gh.dtype)
                grad_hidden[r] = gh
            if gw is not None:
                grad_weight += gw.to(torch.bfloat16)
            if gb is not None:
                grad_bias += gb.float()
        return Grads(grad_hidden, None if grad_weight is None else grad_weight.float(), grad_bias)


class KeptLogitsReused(MutantStages):
    """The kept logits' buffer handed back after the first backward (zeroed here; a caching
    allocator would hand it to the next tensor): a second backward (retain_graph) reads it."""

    def backward_grads(
        self, hidden, weight, bias, targets, vocab_start, logit, rows, wanted, *dt, **kw
    ):
        grads = self.inner.backward_grads(
            hidden, weight, bias, targets, vocab_start, logit, rows, wanted, *dt, **kw
        )
        _, *kept = dt or (None,)  # after grad_hidden's dtype, as in `Bf16GradWeight`
        for logits in kept:  # as a kernel writes memory: no autograd version bump
            logits.data.zero_()
        return grads


class BiasGradDropped(MutantStages):
    """The bias enters the logits but its gradient comes back zero (the head's bias frozen)."""

    def backward_grads(self, *args, **kw):
        grads = self.inner.backward_grads(*args, **kw)
        if grads.bias is None:
            return grads
        return grads._replace(bias=torch.zeros_like(grads.bias))


def _cap_after_temperature() -> contextlib.AbstractContextManager:
    """The softcap bends ``s a / T`` (``cap tanh(s a / (T cap))``), not ``s a``: the map's order
    swapped, as ports that fold the temperature into the logits before the cap compute."""
    stack = contextlib.ExitStack()
    cap_scale = property(lambda o: o.logit_scale / (o.temperature * (o.softcap or 1.0)))
    centred = property(
        lambda o: o.softcap if o.softcap is not None else o.logit_scale / o.temperature
    )
    stack.enter_context(mock.patch.object(LogitOptions, "cap_scale", cap_scale))
    stack.enter_context(mock.patch.object(LogitOptions, "centred_scale", centred))
    return stack


def _smoothing_without_complement(logprob, lse, smooth, logit):
    """``-log p_y + eps smooth``: the target's weight left at 1 instead of ``1 - eps``."""
    loss, z_term = _ORIGINAL_TOKEN_LOSS(logprob, lse, smooth, logit)
    eps = logit.label_smoothing
    return (loss - eps * logprob if eps else loss), z_term


def _smoothing_upstream_without_complement(grad_loss, lse, logit):
    upstream = _ORIGINAL_LOSS_UPSTREAM(grad_loss, lse, logit)
    eps = logit.label_smoothing
    return upstream._replace(logprob=upstream.logprob - eps * grad_loss) if eps else upstream


def _patch_loss_terms(token_loss, loss_upstream) -> Callable[[], contextlib.AbstractContextManager]:
    """Replace the loss formula and its derivative wherever lce imported them."""

    def patch() -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for module in (lce.autograd, lce.loss_pass):
            if hasattr(module, "token_loss"):
                stack.enter_context(mock.patch.object(module, "token_loss", token_loss))
            if hasattr(module, "loss_upstream"):
                stack.enter_context(mock.patch.object(module, "loss_upstream", loss_upstream))
        return stack

    return patch


def _z_term_detached(logprob, lse, smooth, logit):
    """The z-loss is in the loss value, but its gradient ``2 c lse`` never reaches the logits."""
    loss, z_term = _ORIGINAL_TOKEN_LOSS(logprob, lse, smooth, logit)
    if z_term is None:
        return loss, z_term
    return loss - z_term + z_term.detach(), z_term


def _z_upstream_dropped(grad_loss, lse, logit):
    return _ORIGINAL_LOSS_UPSTREAM(grad_loss, lse, replace(logit, z_loss=0.0))


def _smoothing_over_local_vocab(stats, target_owned, shard, logit):
    """Each rank's label smoothing averages its own shard's logits, not the whole vocabulary's."""
    merged = _ORIGINAL_MERGE(stats, target_owned, shard, logit)
    if logit.label_smoothing == 0 or shard.group is None or shard.vocab_local == 0:
        return merged
    shift = (stats.max - merged.max) * logit.centred_scale
    local_mean = (stats.sum_centred + shard.vocab_local * shift) / shard.vocab_local
    return replace(merged, mean_centred=local_mean, inv_vocab=torch.full_like(local_mean,
                   1.0 / shard.vocab_local))  # fmt: skip


def _patch_merge(merge) -> Callable[[], contextlib.AbstractContextManager]:
    """Replace the TP merge of the shard statistics wherever lce imported it."""

    def patch() -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for module in (lce.autograd, lce.loss_pass):
            stack.enter_context(mock.patch.object(module, "merge_stats", merge))
        return stack

    return patch


def _wrap_stages(cls) -> Callable[[], contextlib.AbstractContextManager]:
    original = lce.plan.get_stages
    return lambda: mock.patch.object(lce.plan, "get_stages", lambda *a, **k: cls(original(*a, **k)))


def _off_by_one(targets, vocab_start, vocab_local):
    local = targets - vocab_start
    owned = (local >= 0) & (local <= vocab_local)  # the bug: <= claims the next shard's first id
    return local.clamp(0, max(vocab_local - 1, 0)), owned


def _mean_over_all_rows(hidden, weight, targets, *, reduction="mean", **kwargs):
    loss = _ORIGINAL_LCE(
        hidden, weight, targets, reduction="sum" if reduction == "mean" else reduction, **kwargs
    )
    return loss / targets.numel() if reduction == "mean" else loss


def _ignored_not_zeroed(hidden, weight, bias, targets, plan, *keep):
    clamped = torch.where(targets == plan.options.ignore_index, 0, targets)  # read as id 0
    return _ORIGINAL_TOKEN_OUTPUTS(hidden, weight, bias, clamped, plan, *keep)


def _cast_in_place(hidden, weight, bias, targets, plan, *keep):
    if hidden.dtype != weight.dtype:
        with torch.no_grad():
            hidden.copy_(hidden.to(weight.dtype))  # the matmul cast, done on the caller's tensor
    return _ORIGINAL_TOKEN_OUTPUTS(hidden, weight, bias, targets, plan, *keep)


def _scaled_in_input_dtype(grad, factor, dtype):
    # TE #3193: the gradient stored in the input dtype, then scaled by the upstream in that dtype:
    # two roundings where the fp32 product rounds once.
    low = grad.to(dtype)
    return low * factor.to(dtype)


def _scaled_in_place(grad, factor, dtype):
    # Liger's element_mul, quack #209: the saved gradient scaled where it lies (untracked, as a
    # kernel writing its input is), so a second backward scales it again.
    grad.data.mul_(factor)
    return grad.to(dtype, copy=True)


class PartialsRounded(MutantStages):
    """Megatron #2739 family: each rank's fp32 partial grad_hidden rounded to the GEMMs' dtype
    (bf16 in a bf16 model) before the TP sum (4-GEMM backward; `_loss_pass_partials_rounded`
    bends the 3-GEMM loss pass alike)."""

    def backward_grads(self, *args, **kwargs):
        grads = self.inner.backward_grads(*args, **kwargs)
        weight = args[1]
        # grad_hidden in fp32 is a partial for the TP sum (in the output's dtype: summed no more)
        if grads.hidden is not None and grads.hidden.dtype != weight.dtype:
            grads = grads._replace(hidden=grads.hidden.to(weight.dtype).to(grads.hidden.dtype))
        return grads


def _loss_pass_partials_rounded(loss_pass):
    def rounded(stages, hidden, weight, bias, targets, shard, *rest, **options):
        out = loss_pass(stages, hidden, weight, bias, targets, shard, *rest, **options)
        partial = out.grads.hidden
        if partial is not None and shard.group is not None:
            partial.copy_(partial.to(weight.dtype))
        return out

    return rounded


@contextlib.contextmanager
def _round_tp_partials() -> Iterator[None]:
    with contextlib.ExitStack() as patches:
        patches.enter_context(_wrap_stages(PartialsRounded)())
        for module in (lce.autograd, lce.grad_buffer):
            rounded = _loss_pass_partials_rounded(module.loss_pass)
            patches.enter_context(mock.patch.object(module, "loss_pass", rounded))
        yield


def _vocab_grad_partial(hidden, weight, *args, **kwargs):
    """A vocab-sharded DTensor weight's local rows taken with ``to_local(grad_placements=
    [Partial()])``: the gradient's values are the shard's, its placement says "sum me"."""
    call = _ORIGINAL_LOCAL_CALL(hidden, weight, *args, **kwargs)
    if not lce.dtensor.is_dtensor(weight) or weight.placements[0].is_replicate():
        return call
    from torch.distributed.tensor import Partial

    return call._replace(weight=weight.to_local(grad_placements=[Partial()]))


class _PlainGrad(torch.autograd.Function):
    """A DTensor weight's local tensor whose backward hands the DTensor a plain tensor."""

    @staticmethod
    def forward(ctx, weight):
        return weight.to_local().clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _grad_as_plain_tensor(hidden, weight, *args, **kwargs):
    """A DTensor weight unwrapped by a hand-written autograd function that returns the local
    gradient as it is (a plain tensor): autograd takes it where the shapes agree (a mesh of one)
    and refuses it elsewhere."""
    call = _ORIGINAL_LOCAL_CALL(hidden, weight, *args, **kwargs)
    if not lce.dtensor.is_dtensor(weight):
        return call
    return call._replace(weight=_PlainGrad.apply(weight))


def _replicate_as_vocab_parallel(hidden, weight, *args, **kwargs):
    """Every DTensor weight run on its mesh's group, a replicated one too: each rank's whole
    vocabulary counted once per rank (the placement never checked)."""
    call = _ORIGINAL_LOCAL_CALL(hidden, weight, *args, **kwargs)
    if lce.dtensor.is_dtensor(weight) and call.tp_group is None:
        return call._replace(tp_group=weight.device_mesh.get_group())
    return call


_ORIGINAL_LOCAL_CALL = lce.dtensor.local_call
_ORIGINAL_LCE = lce.api.linear_cross_entropy
_ORIGINAL_TOKEN_OUTPUTS = lce.autograd.token_statistics
_ORIGINAL_TOKEN_LOSS = lce.loss_terms.token_loss
_ORIGINAL_LOSS_UPSTREAM = lce.loss_terms.loss_upstream
_ORIGINAL_MERGE = lce.tp.merge_stats


@contextlib.contextmanager
def _patch_lce_loss() -> Iterator[None]:
    with mock.patch.object(lce, "linear_cross_entropy", _mean_over_all_rows):
        yield


MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in (
        Mutant("padded_lanes_zero", "padded vocab lanes of a tile read as logit 0, not -inf",
               _wrap_stages(PaddedLanesZero)),
        Mutant("max_starts_at_zero", "running max initialised to 0 instead of -inf",
               _wrap_stages(MaxStartsAtZero)),
        Mutant("mean_over_all_rows", "reduction='mean' divides by all rows, ignored ones too",
               _patch_lce_loss),
        Mutant("grad_output_row0", "only grad_output[0] applied to every row",
               _wrap_stages(_rows(_first_row_only))),
        Mutant("grad_hidden_not_reduced", "grad_hidden not summed over TP ranks",
               lambda: mock.patch.object(lce.autograd, "reduce_grad_hidden", lambda g, group: g),
               min_tp=2),
        Mutant("foreign_target_zeroes_row", "a target on another rank zeroes that row's gradient",
               _wrap_stages(_rows(_zero_foreign_rows)), min_tp=2),
        Mutant("entropy_without_temperature", "entropy's sum p*z over logits not divided by T",
               _wrap_stages(EntropyWithoutTemperature)),
        Mutant("grad_weight_bf16_accumulation", "grad_weight accumulated across chunks in bf16",
               _wrap_stages(Bf16GradWeight)),
        # The Triton kernels test ownership in-kernel: this patch reaches the torch backend only.
        Mutant("shard_boundary_off_by_one", "shard ownership test `<= V_local` (off by one)",
               lambda: mock.patch.object(torch_chunked, "_local_targets", _off_by_one),
               backends=("torch",), min_tp=2),
        Mutant("ignored_rows_not_zeroed", "ignore_index rows computed as target 0, not zeroed",
               lambda: mock.patch.object(lce.autograd, "token_statistics", _ignored_not_zeroed)),
        Mutant("int32_offset_wrap", "row * V offsets wrap (int32 overflow, simulated at 2^9)",
               _wrap_stages(Int32Wrap)),
        Mutant("hidden_cast_not_undone", "hidden's cast to weight's dtype done in place",
               lambda: mock.patch.object(lce.autograd, "token_statistics", _cast_in_place)),
        Mutant("grad_rounded_twice",
               "fast loss: saved gradient rounded to the input dtype, then scaled there",
               lambda: mock.patch.object(lce.autograd, "scaled_copy", _scaled_in_input_dtype)),
        Mutant("tp_partials_rounded", "partial grad_hidden rounded to bf16 (the GEMMs' dtype) "
               "before the TP sum", _round_tp_partials, min_tp=2),
        Mutant("kept_logits_reused", "kept logits' buffer reused after the first backward "
               "(a second backward reads it)", _wrap_stages(KeptLogitsReused)),
        Mutant("saved_grads_scaled_in_place",
               "fast loss: backward scales its saved gradients in place (twice on a 2nd backward)",
               lambda: mock.patch.object(lce.autograd, "scaled_copy", _scaled_in_place)),
        # Model options (`lce.LogitOptions`): each mutant bends one option the way ports get it
        # wrong; it changes nothing on a case without that option.
        Mutant("cap_after_temperature", "softcap applied to s*a/T instead of s*a (order swapped)",
               _cap_after_temperature),
        Mutant("bias_grad_dropped", "the bias shapes the logits but gets a zero gradient",
               _wrap_stages(BiasGradDropped)),
        Mutant("smoothing_without_complement", "label smoothing adds eps*smooth to the full "
               "-log p_y (target weight 1, not 1 - eps)",
               _patch_loss_terms(_smoothing_without_complement,
                                 _smoothing_upstream_without_complement)),
        Mutant("z_loss_without_gradient", "z-loss in the loss value, its gradient dropped",
               _patch_loss_terms(_z_term_detached, _z_upstream_dropped)),
        Mutant("smoothing_over_local_vocab", "label smoothing's mean over this rank's shard only",
               _patch_merge(_smoothing_over_local_vocab), min_tp=2),
        # DTensor weights (`lce.dtensor`): only cases with a DTensor weight reach them.
        Mutant("dtensor_grad_partial", "a Shard(0) weight's gradient handed back as Partial()",
               lambda: mock.patch.object(lce.api, "local_call", _vocab_grad_partial)),
        Mutant("dtensor_grad_plain", "a DTensor weight's gradient handed back as a plain "
               "local tensor", lambda: mock.patch.object(lce.api, "local_call",
                                                         _grad_as_plain_tensor)),
        Mutant("dtensor_replicate_as_shard", "a Replicate weight run vocab-parallel on its mesh "
               "(V counted once per rank)",
               lambda: mock.patch.object(lce.api, "local_call", _replicate_as_vocab_parallel),
               min_tp=2),
    )
}  # fmt: skip


@contextlib.contextmanager
def applied(name: str | None) -> Iterator[None]:
    """Run the block with mutant ``name`` planted (``None``: nothing planted)."""
    if name is None:
        yield
        return
    if name not in MUTANTS:
        raise ValueError(f"unknown mutant {name!r}; known: {', '.join(MUTANTS)}")
    with MUTANTS[name].patch():
        yield
