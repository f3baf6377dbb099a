"""Value checks on the host or on the device (`lce.validation.host_checks`): the named errors where
reading the data costs no sync, device-side asserts where it would, never a sync in graph capture.

The CPU always checks on the host. The device branches are the ones CUDA takes; here they run on
CPU tensors with the policy decided as on CUDA (``torch._assert_async`` raises at once on the CPU,
so its condition and message are checked the same). tests/lce/test_cuda_hot_path.py runs the real
thing on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import lce
import lce.grad_buffer
import lce.validation
from lce.grad_buffer import ASSUMED_UPSTREAM_ASSERT
from lce.validation import (
    HOST_CHECKS_ENV,
    TARGETS_ASSERT,
    assert_target_ids,
    host_checks,
    host_checks_setting,
)
from tests.helpers.checks import BACKENDS, core_problem

T, H, V = 37, 40, 97
# A device-side assert on a CPU tensor raises RuntimeError carrying its message.
TARGETS_FAILED = "lce: targets hold ids outside"
UPSTREAM_FAILED = "lce grad_weight_into: the loss's upstream gradient is not assumed_loss_grad"
# main_grad's content before a grad_weight_into call: not zeros, so an overwrite would show.
OLD_CONTENT = torch.linspace(-1.0, 1.0, V * H).view(V, H)


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(HOST_CHECKS_ENV, raising=False)
    return monkeypatch


def _on_cuda_by_default(monkeypatch) -> None:
    """Decide every check as CUDA does outside graph capture with the variable unset."""

    def policy(device: torch.device, default: bool = False) -> bool:
        return host_checks_setting(default)

    monkeypatch.setattr(lce.validation, "host_checks", policy)
    monkeypatch.setattr(lce.grad_buffer, "host_checks", policy)


@pytest.mark.parametrize(("value", "default", "expected"), [
    (None, True, True), (None, False, False), ("", True, True),
    ("1", False, True), ("0", True, False),
])  # fmt: skip
def test_the_variable_overrides_each_check_default(no_env, value, default, expected):
    if value is not None:
        no_env.setenv(HOST_CHECKS_ENV, value)
    assert host_checks_setting(default) is expected


def test_a_bad_setting_raises_naming_the_variable(no_env):
    no_env.setenv(HOST_CHECKS_ENV, "yes")
    with pytest.raises(ValueError, match=f"{HOST_CHECKS_ENV} must be 1 .* or unset, got 'yes'"):
        host_checks_setting(False)


@pytest.mark.parametrize("capturing", [False, True])
@pytest.mark.parametrize("value", [None, "0", "1"])
@pytest.mark.parametrize("default", [False, True])
def test_cuda_policy_never_syncs_in_graph_capture(no_env, capturing, value, default):
    if value is not None:
        no_env.setenv(HOST_CHECKS_ENV, value)
    no_env.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    expected = False if capturing else {None: default, "0": False, "1": True}[value]
    assert host_checks(torch.device("cuda", 0), default) is expected
    # The CPU has no sync to avoid: always on the host, whatever the variable says.
    assert host_checks(torch.device("cpu"), default) is True


def test_the_device_assert_fails_on_bad_ids_only():
    targets = torch.tensor([0, 5, -100, 9, 7])
    owners = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])  # the ignored token is owned by no shard
    assert_target_ids(targets, owners, ignore_index=-100)
    for owners_of_last in (0.0, 2.0):  # outside [0, V); two overlapping shards
        owners[-1] = owners_of_last
        with pytest.raises(RuntimeError, match=TARGETS_FAILED):
            assert_target_ids(targets, owners, ignore_index=-100)
    assert len(TARGETS_ASSERT) < 255 and len(ASSUMED_UPSTREAM_ASSERT) < 255  # CUDA's message cap


def test_the_cpu_names_the_ids_even_with_device_asserts_asked_for(no_env):
    no_env.setenv(HOST_CHECKS_ENV, "0")
    problem = core_problem(T, H, V, seed=5)
    targets = problem.targets.clone()
    targets[3] = V
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, V\): {V}"):
        lce.token_logprobs(problem.hidden, problem.weight, targets)


def _bad_target_calls(problem, targets, backend):
    hidden = problem.hidden.clone().requires_grad_()
    weight = problem.weight.clone().requires_grad_()
    common = dict(backend=backend, chunk_size=8)
    return {
        "tokens": lambda: lce.token_logprobs(hidden, weight, targets, **common),
        "mean": lambda: lce.linear_cross_entropy(hidden, weight, targets, **common),
        "fast": lambda: lce.linear_cross_entropy(hidden, weight, targets, fast=True, **common),
        "grad_weight_into": lambda: lce.linear_cross_entropy(
            hidden, weight, targets, grad_weight_into=torch.zeros(V, H), **common
        ),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_path_asserts_bad_targets_on_the_device_branch(no_env, backend):
    _on_cuda_by_default(no_env)
    problem = core_problem(T, H, V, seed=6)
    bad = problem.targets.clone()
    bad[4] = V + 3
    for path, call in _bad_target_calls(problem, bad, backend).items():
        with pytest.raises(RuntimeError, match=TARGETS_FAILED):
            call()
        # And the host branch, which LCE_HOST_CHECKS=1 selects, names the ids as on the CPU.
        no_env.setenv(HOST_CHECKS_ENV, "1")
        with pytest.raises(ValueError, match=f"outside the vocabulary .*: {V + 3}"):
            call()
        no_env.delenv(HOST_CHECKS_ENV)
        call_ok = _bad_target_calls(problem, problem.targets, backend)[path]
        call_ok()  # valid (and ignored) targets pass the assert


def _buffer_loss(problem, reduction, upstream, backend="torch"):
    """main_grad after one grad_weight_into call and backward with ``upstream`` on the loss."""
    hidden = problem.hidden.clone().requires_grad_()
    weight = problem.weight.clone().requires_grad_()
    buffer = OLD_CONTENT.clone()
    loss = lce.linear_cross_entropy(
        hidden, weight, problem.targets, reduction=reduction, grad_weight_into=buffer,
        backend=backend, chunk_size=8,
    )  # fmt: skip
    loss.backward(upstream)
    return buffer, hidden.grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_scalar_loss_asserts_its_upstream_by_default_on_cuda(no_env, backend):
    problem = core_problem(T, H, V, seed=7)
    host_buffer, host_grad = _buffer_loss(problem, "mean", torch.tensor(1.0), backend)
    _on_cuda_by_default(no_env)
    # The assumption (1.0) held: the device branch leaves the same bits, with no recompute.
    buffer, grad = _buffer_loss(problem, "mean", torch.tensor(1.0), backend)
    assert torch.equal(buffer, host_buffer) and torch.equal(grad, host_grad)
    with pytest.raises(RuntimeError, match=UPSTREAM_FAILED):
        _buffer_loss(problem, "mean", torch.tensor(-0.37), backend)
    # LCE_HOST_CHECKS=1 recomputes every row for the true upstream instead, as the CPU always does.
    no_env.setenv(HOST_CHECKS_ENV, "1")
    buffer, _ = _buffer_loss(problem, "mean", torch.tensor(-0.37), backend)
    # The gains are fp32 sums of the same terms scaled by -0.37, rounded apart (a few ulps of the
    # old content, |old| <= 1, and of the terms): 1e-6 absolute, 1e-4 relative covers them.
    torch.testing.assert_close(
        buffer - OLD_CONTENT, -0.37 * (host_buffer - OLD_CONTENT), rtol=1e-4, atol=1e-6
    )


def test_per_token_losses_recompute_by_default_and_assert_when_asked(no_env):
    problem = core_problem(T, H, V, seed=8)
    mask = (torch.arange(T) % 3 != 0).float()  # a loss mask: upstream 0 on every third token
    exact, _ = _buffer_loss(problem, "none", mask)
    _on_cuda_by_default(no_env)
    buffer, _ = _buffer_loss(problem, "none", mask)
    assert torch.equal(buffer, exact)
    ones, _ = _buffer_loss(problem, "none", torch.ones(T))
    assert not torch.equal(ones, exact)  # the mask changed the gradient: the recompute ran
    no_env.setenv(HOST_CHECKS_ENV, "0")
    with pytest.raises(RuntimeError, match=UPSTREAM_FAILED):
        _buffer_loss(problem, "none", mask)
