"""Every logit option on the three loss paths of `lce.linear_cross_entropy` (default 4-GEMM,
``fast=True`` and ``grad_weight_into``), both backends: the loss, its z term and the gradients of
hidden, weight and bias against the float64 formula of `option_reference`, with the typical bug
of each option shown to fail the same tolerance; and the loss terms' contract (added only when
asked, ignored rows exactly 0, all-ignored mean NaN with zero gradients)."""

from __future__ import annotations

import math

import pytest
import torch

import lce
from tests.helpers.checks import BACKENDS
from tests.helpers.option_reference import (
    ALL_OPTIONS,
    IGNORE,
    MAP_FIELDS,
    PATHS,
    assert_caught,
    assert_close,
    expected,
    leaf,
    make_problem,
    reference,
    run_path,
    upstream,
)

# fp32 on both backends: as in test_logit_map (logits from 32-term fp32 dots, O(1) Lipschitz
# constants, |z| <= ~30 without a cap): the measured worst is 9e-7 of the largest reference
# value (grad_weight_into's buffer, old content included), 1e-5 leaves a 10x margin. The scalar
# loss gets an upstream of -0.37; grad_weight_into assumes 1.0 and gets the problem's random
# per-token upstream instead, so its backward settles every row (`option_reference.upstream`).
REL = 1e-5
MAP = {name: ALL_OPTIONS[name] for name in MAP_FIELDS}
# (options, with a bias, the planted bugs each case must catch)
OPTION_SETS = {
    "softcap": (
        {"softcap": 5.0, "temperature": 0.7}, False, ("no_cap", "cap_after_temperature")
    ),
    "logit_scale": ({"logit_scale": 1.3, "temperature": 0.7}, False, ("no_scale",)),
    "bias": ({}, True, ("no_bias",)),
    "z_loss": ({"z_loss": 0.05}, False, ("no_z_loss",)),
    "label_smoothing": ({"label_smoothing": 0.2}, False, ("no_smoothing",)),
    "all": (ALL_OPTIONS, True, ("cap_after_temperature", "no_bias", "no_z_loss", "no_smoothing")),
}  # fmt: skip
PROBLEM = make_problem(seed=2, tokens=17, vocab=300)


def run(path, backend, options, with_bias, targets=None):
    """`run_path` on the shared problem in fp32: ``(loss, z_loss, grads)``."""
    leaves = (leaf(PROBLEM.hidden, torch.float32), leaf(PROBLEM.weight, torch.float32))
    leaves += (leaf(PROBLEM.bias, torch.float32) if with_bias else None,)
    targets = PROBLEM.targets if targets is None else targets
    (loss, z_loss), grads = run_path(
        path, backend, options, leaves, targets, upstream(PROBLEM, path)
    )
    return loss, z_loss, grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("option_set", OPTION_SETS)
def test_loss_and_grads_match_the_formula(option_set, path, backend):
    options, with_bias, bugs = OPTION_SETS[option_set]
    loss, z_loss, grads = run(path, backend, options, with_bias)
    ref = reference(PROBLEM, with_bias=with_bias, **options)
    objective, want_loss, want_z = expected(PROBLEM, path, ref)
    want_grads = ref.grads(objective)
    assert_close("loss", loss, want_loss, REL)
    assert_close("z_loss", z_loss, want_z, REL)
    assert not z_loss.requires_grad
    for name, got, want in zip(("hidden", "weight", "bias"), grads, want_grads, strict=True):
        if want is not None:
            assert got is not None, f"no gradient for {name}"
            assert_close(f"grad_{name}", got, want, REL)
    for bug in bugs:
        planted = reference(PROBLEM, with_bias=with_bias, variant=bug, **options)
        planted_objective, planted_loss, _ = expected(PROBLEM, path, planted)
        assert_caught(f"{bug}: loss", planted_loss, want_loss, REL)
        weight_grad = planted.grads(planted_objective)[1]
        assert_caught(f"{bug}: grad_weight", weight_grad, want_grads[1], REL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["default", "fast"])
def test_loss_terms_are_added_only_when_asked(path, backend):
    """z_loss=0 and label_smoothing=0 compute the plain loss bit for bit (no c * lse^2 term of
    0 * lse^2, no smoothing term of weight 0), and the z term returned is exactly 0. (The buffer
    path's per-token loss is the fast path's `loss_pass`.)"""
    plain_loss, plain_z, plain_grads = run(path, backend, MAP, True)
    asked = {**MAP, "z_loss": 0.0, "label_smoothing": 0.0}
    loss, z_loss, grads = run(path, backend, asked, True)
    assert torch.equal(loss, plain_loss) and not z_loss.any() and not plain_z.any()
    for got, plain in zip(grads, plain_grads, strict=True):
        assert torch.equal(got, plain)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["default", "grad_weight_into"])
def test_ignored_rows_are_exactly_zero_with_every_option(path, backend):
    loss, z_loss, (grad_hidden, _, _) = run(path, backend, ALL_OPTIONS, True)
    ignored = PROBLEM.targets == IGNORE
    assert not loss[ignored].any() and not z_loss[ignored].any()
    assert not grad_hidden[ignored].any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", PATHS)
def test_an_all_ignored_mean_is_nan_with_zero_gradients(path, backend):
    targets = torch.full_like(PROBLEM.targets, IGNORE)
    hidden, weight = leaf(PROBLEM.hidden, torch.float32), leaf(PROBLEM.weight, torch.float32)
    bias = leaf(PROBLEM.bias, torch.float32)
    extra = {"fast": {"fast": True}, "default": {}}.get(path)
    buffer = torch.zeros(weight.shape)
    kwargs = extra if extra is not None else {"grad_weight_into": buffer}
    loss, z_loss = lce.linear_cross_entropy(
        hidden, weight, targets, bias=bias, backend=backend, return_z_loss=True, **ALL_OPTIONS,
        **kwargs,
    )  # fmt: skip
    loss.backward()
    assert math.isnan(loss.item()) and math.isnan(z_loss.item())
    grad_weight = buffer if path == "grad_weight_into" else weight.grad
    for grad in (hidden.grad, grad_weight, bias.grad):
        assert grad is not None and not grad.any()


def test_full_smoothing_is_the_mean_of_minus_log_p_alone():
    """eps = 1: no log-prob of the target at all (a bug scaling the nll by eps, not 1 - eps,
    would keep it)."""
    loss, _, _ = run("default", "torch", {"label_smoothing": 1.0}, False)
    ref = reference(PROBLEM, with_bias=False, label_smoothing=1.0)
    assert_close("loss", loss, ref.loss, REL)
    shuffled = PROBLEM.targets.roll(1)  # other targets: rows valid in both must agree
    valid = (shuffled != IGNORE) & (PROBLEM.targets != IGNORE)
    other, _, _ = run("default", "torch", {"label_smoothing": 1.0}, False, targets=shuffled)
    torch.testing.assert_close(other[valid], loss[valid], rtol=0, atol=0)


def test_the_bias_gradient_is_rounded_once_whatever_the_chunks():
    """bf16 weight and bias (torch backend): grad_bias sums every chunk's rounded d_logits in fp32
    and rounds once, so one token per chunk and all tokens at once agree to one bf16 rounding; a
    per-chunk bf16 sum would drift by several ulps over 14 chunks."""
    grads = []
    for chunk_size in (1, None):
        bias = leaf(PROBLEM.bias, torch.bfloat16)
        loss = lce.linear_cross_entropy(
            PROBLEM.hidden.bfloat16(), PROBLEM.weight.bfloat16(), PROBLEM.targets, bias=bias,
            backend="torch", chunk_size=chunk_size, reduction="sum", **ALL_OPTIONS,
        )  # fmt: skip
        loss.backward()
        grads.append(bias.grad.float())
    ulp = torch.finfo(torch.bfloat16).eps * grads[1].abs().clamp_min(1e-30)
    assert bool(((grads[0] - grads[1]).abs() <= ulp).all())


def test_the_triton_forward_merges_the_smoothing_sums_of_its_splits(monkeypatch):
    """One vocab tile per forward program (as the GPU config has it): the 300 columns fall into
    two splits of 256 and 44, whose centred sums of the logits the split merge re-centres by each
    split's own column count (the interpreter's default config runs one split here)."""
    pytest.importorskip("triton")
    import dataclasses

    from lce.backends.triton import config, stages

    one_tile = dataclasses.replace(config.default_config(), tiles_per_program=1)
    monkeypatch.setattr(stages, "default_config", lambda: one_tile)
    loss, z_loss, grads = run("default", "triton", ALL_OPTIONS, True)
    ref = reference(PROBLEM, **ALL_OPTIONS)
    objective, want_loss, want_z = expected(PROBLEM, "default", ref)
    assert_close("loss", loss, want_loss, REL)
    assert_close("z_loss", z_loss, want_z, REL)
    want_grads = ref.grads(objective)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, want_grads, strict=True):
        assert_close(f"grad_{name}", got, want, REL)
