"""lce's hot path on CUDA: forward and backward make no host sync, and each path captured in a CUDA
graph replays new inputs exactly as eager runs them. Skipped without CUDA (the GPU runs it).

Every path of docs/DESIGN.md's "Host syncs and CUDA graphs" on both backends, bf16 as in training:
per-token outputs, the default mean loss, ``fast=True``, ``grad_weight_into`` (mean, and per-token
with the assumed upstream).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch

import lce
from lce.validation import HOST_CHECKS_ENV

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# T and V are no multiple of a tile; every tenth token is ignored.
T, H, V = 300, 128, 1000
IGNORE_INDEX = -100
BACKENDS = ("triton", "torch")
SYNC_FREE_PATHS = ("tokens", "mean", "fast", "grad_weight_into")
PATHS = (*SYNC_FREE_PATHS, "grad_weight_into_none")


@dataclass
class Inputs:
    """One step's inputs; for a captured graph, the static buffers new inputs are copied into."""

    hidden: torch.Tensor  # [T, H] bf16 leaf
    weight: torch.Tensor  # [V, H] bf16 leaf, rows of unequal norms
    targets: torch.Tensor  # [T] int64, every tenth ignored
    grad_logprob: torch.Tensor  # [T] fp32 upstream of the per-token outputs
    grad_entropy: torch.Tensor
    main_grad: torch.Tensor  # [V, H] fp32: grad_weight_into's buffer, with old content


def make_inputs(seed: int) -> Inputs:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    targets = torch.randint(0, V, (T,), generator=gen, device="cuda")
    targets[::10] = IGNORE_INDEX
    row_norms = 0.2 * randn(V, 1).exp()  # log-normal: some vocab rows dominate, as in LM heads
    return Inputs(
        hidden=randn(T, H).bfloat16().requires_grad_(),
        weight=(randn(V, H) * row_norms).bfloat16().requires_grad_(),
        targets=targets,
        grad_logprob=randn(T),
        grad_entropy=randn(T),
        main_grad=randn(V, H),
    )


def copy_into(static: Inputs, new: Inputs) -> None:
    with torch.no_grad():
        for field in fields(Inputs):
            getattr(static, field.name).copy_(getattr(new, field.name))


def step(path: str, backend: str, x: Inputs) -> list[torch.Tensor]:
    """One forward and backward of ``path``: its outputs, then its gradients (main_grad for the
    ``grad_weight_into`` paths, whose weight gradient goes there)."""
    if path == "tokens":
        out = lce.token_logprobs(x.hidden, x.weight, x.targets, backend=backend)
        grads = torch.autograd.grad(
            (out.logprobs, out.entropy), (x.hidden, x.weight), (x.grad_logprob, x.grad_entropy)
        )
        return [out.logprobs, out.entropy, *grads]
    if path.startswith("grad_weight_into"):
        reduction = "none" if path.endswith("none") else "mean"
        loss = lce.linear_cross_entropy(
            x.hidden, x.weight, x.targets, reduction=reduction, backend=backend,
            grad_weight_into=x.main_grad,
        )  # fmt: skip
        # The upstream the forward assumed (assumed_loss_grad=1); any other asserts under capture.
        (grad_hidden,) = torch.autograd.grad(loss, (x.hidden,), torch.ones_like(loss))
        return [loss, grad_hidden, x.main_grad]
    loss = lce.linear_cross_entropy(
        x.hidden, x.weight, x.targets, backend=backend, fast=path == "fast"
    )
    return [loss, *torch.autograd.grad(loss, (x.hidden, x.weight))]


@pytest.fixture
def default_checks(monkeypatch):
    monkeypatch.delenv(HOST_CHECKS_ENV, raising=False)
    return monkeypatch


def _under_sync_errors(path: str, backend: str, x: Inputs) -> None:
    step(path, backend, x)  # the first call compiles the Triton kernels: not the hot path
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(path, backend, x)
        with pytest.raises(RuntimeError):  # the mode is on: a sync does raise here
            x.targets.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", SYNC_FREE_PATHS)
def test_forward_and_backward_make_no_host_sync(default_checks, path, backend):
    _under_sync_errors(path, backend, make_inputs(1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_token_buffer_losses_sync_once_unless_told_not_to(default_checks, backend):
    """Documented: per-token losses into grad_weight_into look for the tokens whose upstream
    differs (one host sync per backward); LCE_HOST_CHECKS=0 asserts the assumption instead."""
    with pytest.raises(RuntimeError, match="synchroniz"):
        _under_sync_errors("grad_weight_into_none", backend, make_inputs(1))
    default_checks.setenv(HOST_CHECKS_ENV, "0")
    _under_sync_errors("grad_weight_into_none", backend, make_inputs(1))


def capture(path: str, backend: str, static: Inputs) -> tuple[torch.cuda.CUDAGraph, list]:
    """``path``'s step captured on ``static``: the graph and its (static) outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile the kernels and warm cuBLAS outside the capture
            step(path, backend, static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(path, backend, static)
    return graph, outputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", PATHS)
def test_a_captured_step_replays_new_inputs_bit_for_bit(default_checks, path, backend):
    """Bit for bit: a replay launches the kernels eager launches, with the same shapes, in the same
    order, on the same data (lce has no atomics, and no shape or launch depends on values); any
    difference means the capture froze something that depends on the captured inputs."""
    static = make_inputs(1)
    graph, replayed = capture(path, backend, static)
    previous = None
    for seed in (2, 3):
        copy_into(static, make_inputs(seed))
        graph.replay()
        eager = step(path, backend, make_inputs(seed))
        torch.cuda.synchronize()
        for index, (got, expected) in enumerate(zip(replayed, eager, strict=True)):
            assert torch.equal(got, expected), f"{path} output {index}, inputs of seed {seed}"
        if previous is not None:  # new inputs gave new results: the replay read them
            assert not torch.equal(previous[0], eager[0]) and not torch.equal(previous[1], eager[1])
        previous = [t.clone() for t in eager]


def test_host_checks_name_the_ids_on_cuda(default_checks):
    default_checks.setenv(HOST_CHECKS_ENV, "1")
    x = make_inputs(4)
    targets = x.targets.clone()
    targets[5] = V
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, V\): {V}"):
            lce.token_logprobs(x.hidden, x.weight, targets, backend=backend)


BAD_TARGET_SCRIPT = """
import torch, lce
hidden = torch.randn(8, 16, device="cuda")
weight = torch.randn(10, 16, device="cuda")
targets = torch.zeros(8, dtype=torch.long, device="cuda")
targets[3] = 10
lce.token_logprobs(hidden, weight, targets, backend="{backend}")
torch.cuda.synchronize()
print("no assert")
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_target_fails_the_stream_by_default(backend):
    """In a process of its own: a device-side assert leaves CUDA unusable for the process."""
    env = {k: v for k, v in os.environ.items() if k != HOST_CHECKS_ENV}
    result = subprocess.run(
        [sys.executable, "-c", BAD_TARGET_SCRIPT.format(backend=backend)],
        capture_output=True, text=True, env=env, timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert result.returncode != 0 and "no assert" not in result.stdout
    assert "device-side assert" in result.stderr, result.stderr[-3000:]
