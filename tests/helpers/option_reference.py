"""The float64 materialized formula of lce's logit options, written here from the definitions and
independent of lce's code, and the one problem the option tests share.

``z = cap * tanh(s * (hidden @ weight.T + bias) / cap) / T``; per-token loss
``(1 - eps) * nll + eps * mean_j(-log p_j) + c * lse**2`` over the whole vocabulary (PyTorch's
label smoothing; the z term only when ``c > 0``). ``variant`` plants one typical bug of each option
in the formula, so a test can show that its tolerance would catch it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

import lce

IGNORE = -100
# A cap well below the logits' magnitude (|s * a| up to ~60 here), so tanh really bends; a scale
# and a temperature that are not 1 and not each other's inverse; a bias spread wide enough to
# change the argmax of most rows; z-loss and smoothing coefficients large enough to move the loss.
ALL_OPTIONS = dict(temperature=0.7, logit_scale=1.3, softcap=5.0, z_loss=0.05, label_smoothing=0.2)
# The bugs `reference` can plant: the cap after the temperature, each option dropped, the z term's
# lse and the smoothing mean over one shard's vocabulary only (``local`` slice).
VARIANTS = (
    "cap_after_temperature", "no_cap", "no_scale", "no_bias", "no_z_loss", "no_smoothing",
    "local_vocab",
)  # fmt: skip


@dataclass(frozen=True)
class Problem:
    """float64 tensors: ``hidden [T, H]``, ``weight [V, H]`` (log-normal row norms), ``bias [V]``,
    ``targets [T]`` (a few ignored), and random non-uniform upstream gradients: ``g_logprob``,
    ``g_entropy`` and ``g_loss`` per token (zero where ignored is not assumed)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    targets: torch.Tensor
    g_logprob: torch.Tensor
    g_entropy: torch.Tensor
    g_loss: torch.Tensor


def make_problem(seed: int = 0, tokens: int = 23, hidden_size: int = 32, vocab: int = 1100):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    hidden = randn(tokens, hidden_size)
    # Row norms spread over ~e^(+-1): uniform rows hide bugs that only bite on a few large rows.
    weight = randn(vocab, hidden_size) * torch.exp(randn(vocab, 1) * 0.5) * (6 / hidden_size**0.5)
    bias = randn(vocab) * 4.0
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[[i for i in (2, 7, 11) if i < tokens]] = IGNORE
    return Problem(hidden, weight, bias, targets, randn(tokens), randn(tokens), randn(tokens))


@dataclass(frozen=True)
class Reference:
    """Per-token float64 outputs (0 on ignored rows) and the leaves they were computed from."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    logprobs: torch.Tensor
    entropy: torch.Tensor
    loss: torch.Tensor
    z_term: torch.Tensor

    def grads(self, objective: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``(d hidden, d weight, d bias)`` of the scalar ``objective`` (bias None without one)."""
        leaves = [t for t in (self.hidden, self.weight, self.bias) if t is not None]
        grads = torch.autograd.grad(objective, leaves, retain_graph=True, allow_unused=True)
        # A planted bug may leave the bias out of the graph: its gradient is then zero.
        grads = [
            torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads, strict=True)
        ]
        return grads[0], grads[1], grads[2] if self.bias is not None else None


def reference(
    problem: Problem,
    *,
    with_bias: bool = True,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    variant: str | None = None,
    local: slice | None = None,
) -> Reference:
    """The materialized float64 outputs of ``problem`` with the options (``variant``: a planted
    bug from `VARIANTS`)."""
    assert variant is None or variant in VARIANTS, variant
    hidden = problem.hidden.clone().requires_grad_()
    weight = problem.weight.clone().requires_grad_()
    bias = problem.bias.clone().requires_grad_() if with_bias else None
    raw = hidden @ weight.T
    if bias is not None and variant != "no_bias":
        raw = raw + bias
    scaled = raw * (1.0 if variant == "no_scale" else logit_scale)
    if softcap is not None and variant == "cap_after_temperature":
        z = softcap * torch.tanh(scaled / temperature / softcap)
    elif softcap is not None and variant != "no_cap":
        z = softcap * torch.tanh(scaled / softcap) / temperature
    else:
        z = scaled / temperature
    log_p = torch.log_softmax(z, dim=-1)
    valid = problem.targets != IGNORE
    picked = log_p.gather(1, problem.targets.clamp(min=0)[:, None]).squeeze(1)
    logprobs = torch.where(valid, picked, 0.0)
    entropy = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
    window = z[:, local] if variant == "local_vocab" else z
    lse = torch.logsumexp(window, dim=-1)
    smooth = (lse[:, None] - window).mean(-1)  # mean_j(-log p_j) over the (planted) window
    c = 0.0 if variant == "no_z_loss" else z_loss
    eps = 0.0 if variant == "no_smoothing" else label_smoothing
    z_term = torch.where(valid, c * lse**2, 0.0)
    loss = torch.where(valid, -(1 - eps) * logprobs + eps * smooth, 0.0) + z_term
    return Reference(hidden, weight, bias, logprobs, entropy, loss, z_term)


# The loss paths' reductions and upstreams: per-token random upstreams ("none"; the buffer path
# assumes 1.0 and gets them instead, so its backward settles every row), and for the 3-GEMM scalar
# loss an upstream that is not 1 and negative.
GRAD_LOSS = -0.37
PATHS = ("default", "fast", "grad_weight_into")
MAP_FIELDS = ("temperature", "logit_scale", "softcap")


def upstream(problem: Problem, path: str, dtype: torch.dtype = torch.float32) -> Any:
    """What `run_path` puts on its outputs: ``(g_logprob, g_entropy)`` for "tokens", the scalar
    loss's for "fast", per-token ``g_loss`` otherwise (lce's outputs are fp32, fp64 for fp64)."""
    if path == "tokens":
        return problem.g_logprob.to(dtype), problem.g_entropy.to(dtype)
    if path == "fast":
        return torch.tensor(GRAD_LOSS, dtype=dtype)
    return problem.g_loss.to(dtype)


def run_path(
    path: str,
    backend: str,
    options: dict[str, Any],
    leaves: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    targets: torch.Tensor,
    grads_in: Any,
    **call: Any,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]]:
    """One call of lce on ``path`` ("tokens": `lce.token_logprobs`; "default", "fast" (reduction
    mean, 3 GEMMs), "grad_weight_into": `lce.linear_cross_entropy`, reduction none but fast's) with
    ``leaves = (hidden, weight, bias)``, then backward with ``grads_in`` (`upstream`). Returns the
    outputs (``(logprobs, entropy)`` or ``(loss, z_loss)``) and ``(grad_hidden, grad_weight,
    grad_bias)``; ``call``: extra keywords (the TP group, vocab_start)."""
    hidden, weight, bias = leaves
    if path == "tokens":
        map_options = {k: v for k, v in options.items() if k in MAP_FIELDS}
        outputs = tuple(
            lce.token_logprobs(hidden, weight, targets, bias=bias, backend=backend, **map_options,
                               **call)
        )  # fmt: skip
        torch.autograd.backward(outputs, grads_in)
        return outputs, (hidden.grad, weight.grad, None if bias is None else bias.grad)
    kwargs = {"reduction": "mean", "fast": True} if path == "fast" else {"reduction": "none"}
    old = None
    if path == "grad_weight_into":  # old content as large as a gradient, as after other batches
        old = torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)) * 0.1
        kwargs["grad_weight_into"] = old.clone()
    loss, z_loss = lce.linear_cross_entropy(
        hidden, weight, targets, bias=bias, backend=backend, return_z_loss=True, **kwargs,
        **options, **call,
    )  # fmt: skip
    loss.backward(grads_in)
    grad_weight = weight.grad if old is None else kwargs["grad_weight_into"] - old
    assert old is None or weight.grad is None  # the buffer path leaves weight.grad alone
    return (loss, z_loss), (hidden.grad, grad_weight, None if bias is None else bias.grad)


def expected(problem: Problem, path: str, ref: Reference) -> tuple[torch.Tensor, ...]:
    """The reference's ``(objective, *outputs)`` for ``path``: the objective is ``sum(upstream *
    outputs)`` (its gradients are what `run_path` computes), the outputs as `run_path` returns
    them."""
    if path == "tokens":
        objective = (problem.g_logprob * ref.logprobs).sum()
        return objective + (problem.g_entropy * ref.entropy).sum(), ref.logprobs, ref.entropy
    if path == "fast":
        count = int((problem.targets != IGNORE).sum())
        loss, z_term = ref.loss.sum() / count, ref.z_term.sum() / count
        return GRAD_LOSS * loss, loss, z_term
    return (problem.g_loss * ref.loss).sum(), ref.loss, ref.z_term


def leaf(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh leaf copy of ``tensor`` in ``dtype`` that requires grad (never the problem's own)."""
    return tensor.detach().to(dtype, copy=True).requires_grad_()


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rel: float) -> float:
    """``max|got - want| <= rel * max|want|`` (an all-zero ``want`` asks for zeros); returns
    the measured ratio ``max|got - want| / max|want|``."""
    scale = want.abs().max().item()
    err = (got.detach().double().cpu() - want.detach()).abs().max().item()
    ratio = err / scale if scale > 0 else err
    assert math.isfinite(err) and err <= rel * scale, (
        f"{name}: max err {err:.3e} > {rel} * {scale:.3e}"
    )
    return ratio


def assert_caught(name: str, planted: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """The planted bug moves ``name`` by far more than the tolerance ``rel`` allows (10x): the
    test that uses ``rel`` would catch it."""
    scale = want.abs().max().item()
    err = (planted.detach() - want.detach()).abs().max().item()
    assert err > 10 * rel * scale, f"{name}: the planted bug moves it by {err:.3e} only"
