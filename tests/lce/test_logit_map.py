"""The logit map's options on the per-token path (`lce.token_logprobs`): softcap, logit_scale and
bias against the float64 formula of `option_reference`, outputs and the gradients of hidden, weight
and bias under random upstream gradients on both outputs, on both backends. Each case also shows
that its tolerance catches the option's typical bug (the planted `VARIANTS`)."""

from __future__ import annotations

import pytest
import torch

import lce
from tests.helpers.checks import BACKENDS
from tests.helpers.option_reference import (
    ALL_OPTIONS,
    IGNORE,
    MAP_FIELDS,
    assert_caught,
    assert_close,
    expected,
    leaf,
    make_problem,
    reference,
    run_path,
    upstream,
)

# fp32: logits from 32-term fp32 dots (each within ~32 * 2^-24 of |h| |w|) and fp32 softmax sums;
# every output is Lipschitz in the logits with constants O(1) here (|z| <= cap / T ~ 7, upstreams
# ~1), so 1e-5 of the largest reference value bounds the error with a 10x margin over the
# largest measured (9e-7, either backend). fp64 (torch backend): float64 throughout, only the
# order of sums differs (measured <= 4e-15).
REL = {torch.float32: 1e-5, torch.float64: 1e-12}
DTYPES = {"torch": (torch.float32, torch.float64), "triton": (torch.float32,)}
MAP = {name: ALL_OPTIONS[name] for name in MAP_FIELDS}
# (options, with a bias, the bugs the case must catch)
CASES = {
    "softcap": (
        {"softcap": 5.0, "temperature": 0.7}, False, ("no_cap", "cap_after_temperature")
    ),
    "logit_scale": ({"logit_scale": 1.3, "temperature": 0.7}, False, ("no_scale",)),
    "bias": ({}, True, ("no_bias",)),
    "all": (MAP, True, ("no_cap", "cap_after_temperature", "no_scale", "no_bias")),
}  # fmt: skip
PROBLEM = make_problem(seed=1, tokens=17, vocab=300)


def _token_run(backend, dtype, options, with_bias, chunk_size=None):
    """`run_path` "tokens" on the shared problem: ``((logprobs, entropy), grads)``."""
    leaves = (leaf(PROBLEM.hidden, dtype), leaf(PROBLEM.weight, dtype))
    leaves += (leaf(PROBLEM.bias, dtype) if with_bias else None,)
    grads_in = upstream(PROBLEM, "tokens", dtype)
    return run_path(
        "tokens", backend, options, leaves, PROBLEM.targets, grads_in, chunk_size=chunk_size
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_token_outputs_and_grads_match_the_formula(backend, case):
    options, with_bias, bugs = CASES[case]
    ref = reference(PROBLEM, with_bias=with_bias, **options)
    objective, *_ = expected(PROBLEM, "tokens", ref)
    want_grads = ref.grads(objective)
    for dtype in DTYPES[backend]:
        rel = REL[dtype]
        (logprobs, entropy), grads = _token_run(backend, dtype, options, with_bias, chunk_size=5)
        assert_close("logprobs", logprobs, ref.logprobs, rel)
        assert_close("entropy", entropy, ref.entropy, rel)
        for name, got, want in zip(("hidden", "weight", "bias"), grads, want_grads, strict=True):
            if want is not None:
                assert got is not None, f"no gradient for {name}"
                assert_close(f"grad_{name}", got, want, rel)
    for bug in bugs:  # each would fail the fp32 tolerance above by far
        planted = reference(PROBLEM, with_bias=with_bias, variant=bug, **options)
        assert_caught(f"{bug}: logprobs", planted.logprobs, ref.logprobs, REL[torch.float32])
        planted_grads = planted.grads(expected(PROBLEM, "tokens", planted)[0])
        assert_caught(f"{bug}: grad_weight", planted_grads[1], want_grads[1], REL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_rows_stay_exactly_zero(backend):
    (logprobs, entropy), (grad_hidden, _, _) = _token_run(backend, torch.float32, MAP, True)
    ignored = PROBLEM.targets == IGNORE
    assert not logprobs[ignored].any() and not entropy[ignored].any()
    assert not grad_hidden[ignored].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_huge_common_offset_saturates_the_cap_instead_of_rounding(backend):
    """With a cap, "centred on the row max" means: the capped logits are bounded by cap / T, so a
    common offset of 1e4 (in the bias) saturates every lane instead of rounding their differences
    away at 1e4's magnitude; the float64 formula's softmax is then uniform (the lanes' tanh
    differ by ~e^-600) and every gradient vanishes (the slope 1 - tanh^2 underflows)."""
    bias = leaf(PROBLEM.bias + 1e4, torch.float32)
    hidden, weight = leaf(PROBLEM.hidden, torch.float32), leaf(PROBLEM.weight, torch.float32)
    out = lce.token_logprobs(
        hidden, weight, PROBLEM.targets, bias=bias, backend=backend, softcap=30.0
    )
    (out.logprobs * PROBLEM.g_logprob.float()).sum().backward()
    valid = PROBLEM.targets != IGNORE
    log_v = torch.log(torch.tensor(300.0))
    # fp32 at the logits' magnitude (|z| = 30): a few eps of 30 in each lane, ~1e-6 in log p.
    torch.testing.assert_close(
        out.logprobs[valid], -log_v.expand(int(valid.sum())), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        out.entropy[valid], log_v.expand(int(valid.sum())), atol=1e-5, rtol=0
    )
    for grad in (hidden.grad, weight.grad, bias.grad):
        assert grad.abs().max() < 1e-20  # the slope at |x| = 333 is ~e^-666: zero in fp32


def _confident_problem(vocab=300, hidden_size=8, margin=100.0):
    """Token t is ``e_t``; row ``targets[t]`` holds ``+margin`` in column t, every other row
    ``-margin``: raw logits +-100, capped at 30 to +-29.9, so log p_y ~ -(V-1) e^-59.85 ~ -3e-24.
    """
    hidden = torch.eye(4, hidden_size, dtype=torch.float64)
    weight = torch.full((vocab, hidden_size), -margin, dtype=torch.float64)
    targets = torch.tensor([0, 5, 17, vocab - 1])
    weight[targets, torch.arange(4)] = margin
    return hidden, weight, targets


@pytest.mark.parametrize("backend", BACKENDS)
def test_confident_rows_keep_relative_precision_under_a_cap(backend):
    """``log p_y`` ~ -3e-24 and ``1 - p_y`` on the target lane keep their relative precision
    with a cap (log1p / expm1 of the non-max terms, never 1 + tiny - 1 at eps(1))."""
    hidden, weight, targets = _confident_problem()
    cap = 30.0
    h = leaf(hidden, torch.float32)
    out = lce.token_logprobs(h, weight.float(), targets, backend=backend, softcap=cap)
    out.logprobs.sum().backward()
    # The exact values in float64, written with log1p / expm1 so they keep the tiny terms.
    t = torch.tanh(hidden @ weight.T / cap)
    centred = cap * (t - t.gather(1, targets[:, None]))  # <= 0; 0 on the target lane
    others = centred.exp().scatter(1, targets[:, None], 0.0).sum(1)  # the target's 1 left out
    log_p = -torch.log1p(others)
    p = (centred - torch.log1p(others)[:, None]).exp()
    d_z = -p
    d_z.scatter_(1, targets[:, None], -torch.expm1(log_p)[:, None])
    grad_h = (d_z * (1 - t**2)) @ weight
    # Relative, the values being ~1e-24: a few fp32 roundings of the non-max sum (~1e-7 each);
    # 1e-4 is the confident-row clause's bar. grad_hidden's column t of token t (its target's
    # column) sums no cancelling terms; the other columns cancel to ~1/300 of their terms.
    torch.testing.assert_close(out.logprobs.double(), log_p, rtol=1e-4, atol=0)
    diagonal = torch.arange(4)
    got = h.grad[diagonal, diagonal].double()
    torch.testing.assert_close(got, grad_h[diagonal, diagonal], rtol=1e-4, atol=0)
    assert bool((log_p < -1e-25).all() and (log_p > -1e-22).all())  # the regime it tests
