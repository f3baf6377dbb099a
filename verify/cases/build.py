"""Tensors of a case from its `CaseSpec` alone: one seeded CPU generator, float64, then cast.

The global problem is drawn in a fixed order whatever the spec's options, then cast to the spec's
dtypes; a rank takes its vocab shard of the cast weight. The same spec therefore gives bit-identical
inputs at every TP degree, on every machine. Never the global RNG, never a per-rank seed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from verify.cases.memo import sized_memo
from verify.cases.spec import DTYPES, LINEARITY_A, CaseSpec, shard_bounds
from verify.numerics.reference import IGNORE_INDEX

PEAK_MARGIN = 10.0  # peaked rows: target logit = row max + 10
NEGATIVE_CEILING = 100.0  # negative rows: every logit <= -100 - |offset|
SPREAD_SCALE = 30.0  # spread rows: logit std >= 30, a row range well past exp's 88 underflow
TIE_SCALE = 0.5  # tied: hidden = base + 0.5 * embedding(weight); a power of two, exact in floats
LOSS_SCALAR = -1.25  # upstream of a reduced loss when the pattern is not "ones" (exact in fp32)


@dataclass(frozen=True)
class Problem:
    """The global case, flattened: ``hidden [N, H]``, ``weight [V, H]`` (cast), ``targets [N]``.

    ``hidden`` is what the LM head sees (for tied cases ``hidden_base + TIE_SCALE *
    weight[embed_ids]``, computed in hidden's dtype). Upstream gradients are fp32 ``[N]`` (``None``
    when that output gets none); ``grad_loss`` is ``[N]`` for reduction none, else a 0-d tensor.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    grad_logprob: torch.Tensor
    grad_entropy: torch.Tensor | None
    grad_loss: torch.Tensor
    hidden_base: torch.Tensor | None
    embed_ids: torch.Tensor | None
    offset_feature: bool  # column 0 of hidden is the constant 1 that carries the common offset
    ignore_index: int = IGNORE_INDEX
    bias: torch.Tensor | None = None  # [V] in weight's dtype (None: a bias-free head)

    @property
    def valid(self) -> torch.Tensor:
        return self.targets != self.ignore_index


@dataclass(frozen=True)
class Draws:
    """Every random draw of a case, float64, always in the same order and amount."""

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    target_choice: torch.Tensor
    ignore_choice: torch.Tensor
    upstream: torch.Tensor  # [4, N]: logprob and entropy draws of two independent upstreams
    embed_ids: torch.Tensor
    permutation: torch.Tensor
    retargets: torch.Tensor
    perturbed: torch.Tensor
    bias: torch.Tensor  # drawn last: the draws before it are those of specs saved without a bias


def draw(spec: CaseSpec) -> Draws:
    gen = torch.Generator("cpu").manual_seed(spec.seed)
    n, h, v = spec.num_tokens, spec.hidden_size, spec.vocab
    f64 = {"generator": gen, "dtype": torch.float64}
    hidden = torch.randn(n, h, **f64)
    # Log-normal row norms: uniform random weights hide most bugs (docs/DESIGN.md).
    row_norms = torch.exp(0.5 * torch.randn(v, 1, **f64))
    weight = torch.randn(v, h, **f64) * row_norms
    return Draws(
        hidden=hidden,
        weight=weight,
        targets=torch.randint(0, v, (n,), generator=gen),
        target_choice=torch.rand(n, **f64),
        ignore_choice=torch.rand(n, **f64),
        upstream=torch.randn(4, n, **f64),
        embed_ids=torch.randint(0, v, (n,), generator=gen),
        permutation=torch.randperm(v, generator=gen),
        retargets=torch.randint(0, v, (n,), generator=gen),
        perturbed=torch.randn(n, h, **f64),
        bias=torch.randn(v, **f64),
    )


def build(spec: CaseSpec) -> Problem:
    """The global problem of ``spec`` (after its transform), inputs cast to the spec's dtypes.

    Cached per spec (an example builds one spec for several properties, on the driver and in the
    job); each call returns its own tensors, so a caller may modify them.
    """
    problem = _build(spec)
    return replace(
        problem,
        **{
            f.name: value.clone()
            for f in fields(problem)
            if isinstance(value := getattr(problem, f.name), torch.Tensor)
        },
    )


@sized_memo(max_items=64)
def _untransformed(
    spec: CaseSpec,
) -> tuple[Draws, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Draws, targets and the regime's float64 hidden, weight and bias, shared by the transforms
    (``_offset_column`` alone reads the transform: pass ``unshift`` or ``none``). Read only."""
    d = draw(spec)
    targets = _targets(spec, d)
    return d, targets, *_logit_regime(spec, d, targets)


@sized_memo(max_items=64)
def _build(spec: CaseSpec) -> Problem:
    """`build` without the copy: its tensors are the cache's, never modified in place."""
    base = spec.with_(transform="unshift" if spec.transform == "unshift" else "none")
    d, targets, hidden, weight, bias = _untransformed(base)
    pad = spec.ignore_index
    if spec.transform == "retarget":  # after the regime: peaked rows keep their hidden
        targets = _retargets(spec, d.retargets, targets)
    ignored = _ignored(spec, d.ignore_choice)
    if spec.transform == "perturb_ignored":
        hidden = torch.where(ignored[:, None], d.perturbed * 3.0, hidden)
    if spec.transform == "fold_temperature":
        hidden = hidden / spec.temperature
    embed_ids = d.embed_ids
    if spec.transform == "vocab_permute":
        inverse = torch.argsort(d.permutation)  # new position of each old row
        weight, targets, embed_ids = weight[d.permutation], inverse[targets], inverse[embed_ids]
        bias = None if bias is None else bias[d.permutation]
        if 0 <= pad < spec.vocab:  # the pad row moved too: it is the same token, renamed
            pad = int(inverse[pad])
    targets = torch.where(ignored, pad, targets)
    hidden_c = hidden.to(DTYPES[spec.hidden_dtype])
    weight_c = weight.to(DTYPES[spec.weight_dtype])
    hidden_base = None
    if spec.tied:
        hidden_base = hidden_c
        hidden_c = tied_hidden(hidden_base, weight_c, embed_ids)
    grad_logprob, grad_entropy, grad_loss = _upstream(spec, d.upstream)
    return Problem(
        hidden_c, weight_c, targets, grad_logprob, grad_entropy, grad_loss,
        hidden_base, embed_ids if spec.tied else None, spec.regime in ("offset", "negative"),
        pad, None if bias is None else bias.to(weight_c.dtype),
    )  # fmt: skip


def _retargets(spec: CaseSpec, drawn: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Other targets for the same rows: with a pad id inside the vocabulary, the rows whose target
    was the pad stay ignored and no other row draws it (the ignored set must not change)."""
    pad = spec.ignore_index
    if not 0 <= pad < spec.vocab:
        return drawn.clone()
    other = torch.where(drawn == pad, (pad + 1) % spec.vocab, drawn)
    return torch.where(targets == pad, pad, other)


def tied_hidden(
    hidden_base: torch.Tensor, weight: torch.Tensor, embed_ids: torch.Tensor
) -> torch.Tensor:
    """What the LM head sees in a tied model: ``hidden_base + TIE_SCALE * weight[embed_ids]``,
    looked up as a model's embedding does (`F.embedding`, whose backward sums each id's rows in
    one order: indexing's accumulating backward on the CPU gave two backwards of the same graph
    different fp32 bits at 4097 tokens, which the second-backward clause blamed on the
    implementation)."""
    looked_up = torch.nn.functional.embedding(embed_ids, weight)
    return hidden_base + TIE_SCALE * looked_up.to(hidden_base.dtype)


def edge_ids(vocab: int) -> list[int]:
    """0, V-1 and the first/last ids of every TP=2/4 shard, with their neighbours."""
    ids = {0, vocab - 1}
    for tp in (2, 4):
        if vocab >= tp:
            for start, stop in shard_bounds(vocab, tp):
                ids.update((start - 1, start, start + 1, stop - 1))
    return sorted(i for i in ids if 0 <= i < vocab)


def _targets(spec: CaseSpec, d: Draws) -> torch.Tensor:
    v = spec.vocab
    if spec.target == "edges":
        ids = torch.tensor(edge_ids(v))
        return ids[(d.target_choice * len(ids)).long().clamp_max(len(ids) - 1)]
    if spec.target == "high":
        low = v - max(1, v // 4)
        return low + (d.target_choice * (v - low)).long().clamp_max(v - low - 1)
    if spec.target == "repeated" and spec.num_tokens:
        return d.targets[:1].expand(spec.num_tokens).clone()
    return d.targets.clone()


def _ignored(spec: CaseSpec, choice: torch.Tensor) -> torch.Tensor:
    n = spec.num_tokens
    ignored = torch.zeros(n, dtype=torch.bool)
    if spec.ignore == "first" and n:
        ignored[0] = True
    elif spec.ignore == "random":
        ignored = choice < 0.3
    elif spec.ignore == "chunk":
        ignored[n // 4 : n // 4 + max(1, n // 2)] = True
    elif spec.ignore == "all":
        ignored[:] = True
    return ignored


def _logit_regime(
    spec: CaseSpec, d: Draws, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """float64 hidden, weight and bias whose logits follow ``spec.regime`` (in logit units: raw
    dots are scaled by ``T / s``, temperature and logit scale included; a softcap then bends
    them). The bias has a standard deviation of ``spec.bias`` logits (None when 0)."""
    hidden, weight = d.hidden.clone(), d.weight.clone()
    unit = spec.temperature / spec.logit_scale  # raw units per logit
    bias = d.bias * (spec.bias * unit) if spec.bias else None
    shifted = spec.regime in ("offset", "negative")
    rest = slice(1, None) if shifted else slice(None)
    width = max(weight[:, rest].shape[1], 1)
    scale = max(spec.scale, SPREAD_SCALE) if spec.regime == "spread" else spec.scale
    weight[:, rest] *= scale * unit / width**0.5
    if spec.regime == "peaked" and spec.vocab > 1 and spec.num_tokens:
        _peak(hidden, weight, bias, targets, rest, PEAK_MARGIN * unit)
    if shifted:
        hidden[:, 0] = 1.0
        weight[:, 0] = _offset_column(spec, hidden, weight, bias, unit)
    return hidden, weight, bias


def _offset_column(
    spec: CaseSpec,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    unit: float,
) -> float:
    if spec.transform == "unshift":
        return 0.0
    if spec.regime == "offset":
        return spec.offset * unit
    rest = hidden[:, 1:] @ weight[:, 1:].T + (0.0 if bias is None else bias)
    rest_max = rest.max().item() if spec.num_tokens else 0.0
    ceiling = -(NEGATIVE_CEILING + abs(spec.offset) + 1.0) * unit
    return ceiling - rest_max


def _peak(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    cols: slice,
    margin: float,
) -> None:
    """Move hidden rows so the target's logit leads the runner-up by ``margin`` (raw units)."""
    rows = torch.arange(hidden.shape[0])
    w = weight[:, cols]
    for _ in range(30):  # each step settles one (target, runner-up) pair; others may overtake
        logits = hidden[:, cols] @ w.T + (0.0 if bias is None else bias)
        target_logit = logits[rows, targets]
        logits[rows, targets] = -torch.inf
        others, runner_up = logits.max(dim=1)
        # Along d = w_y - w_r the pair's margin grows by exactly |d|^2 per unit step.
        direction = w[targets] - w[runner_up]
        gain = (direction * direction).sum(1).clamp_min(1e-12)
        step = ((margin - (target_logit - others)) / gain).clamp_min(0.0)
        hidden[:, cols] += step[:, None] * direction


def _upstream(
    spec: CaseSpec, draws: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """fp32 ``[N]`` upstream gradients of logprobs and entropy, and the loss's upstream.

    ``upstream_a``/``upstream_b``/``upstream_mix`` pick the spec's pattern, an independent random
    draw, or ``LINEARITY_A * a + b`` (the upstream-linearity property).
    """
    pattern = {
        "ones": torch.ones_like,
        "scalar": lambda x: torch.full_like(x, -1.75),
        "expanded": lambda x: torch.full_like(x, 0.625),
        "zero_row0": lambda x: torch.cat([torch.zeros_like(x[:1]), x[1:]]),
    }.get(spec.upstream, lambda x: x)
    # Multiples of 2^-8: LINEARITY_A * a + b is then exact in fp32, so linearity is the kernel's.
    draws = torch.round(draws * 256) / 256
    a = (pattern(draws[0]), pattern(draws[1]), _loss_upstream(spec, draws[0], pattern))
    b = (draws[2], draws[3], draws[2] if spec.reduction == "none" else torch.tensor(0.375))
    if spec.transform == "upstream_b":
        chosen = b
    elif spec.transform == "upstream_mix":
        chosen = tuple(LINEARITY_A * x + y for x, y in zip(a, b, strict=True))
    else:
        chosen = a
    grad_logprob, grad_entropy, grad_loss = (g.float() for g in chosen)
    return grad_logprob, None if spec.upstream == "logprob_only" else grad_entropy, grad_loss


def _loss_upstream(spec: CaseSpec, draw: torch.Tensor, pattern) -> torch.Tensor:
    if spec.reduction == "none":
        return pattern(draw)
    return torch.tensor(1.0 if spec.upstream == "ones" else LOSS_SCALAR, dtype=torch.float64)
