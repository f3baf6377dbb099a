"""Double backward (a backward with ``create_graph=True``): right, or refused with a clear error.

For implementations that claim a double-backward contract (`Capabilities.double_backward`: the
backends where it works, without TP, on the default loss path; lce: its torch backend): where
claimed, per-token outputs and the scalar loss are checked in float64 along random directions
against central differences; everywhere else the implementation must raise a RuntimeError naming
double backward and ``create_graph``. A path that does neither (returns second-order terms without
being right) fails: a silent zero was the bug this property was written for. The check runs in a
worker like every case (`Runner.run_check`), on its device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lce.options import LogitOptions
from verify.adapters.interface import Adapter, Call
from verify.cases.build import build
from verify.cases.rank_inputs import effective_temperature
from verify.cases.spec import CaseSpec
from verify.execution.execute import Rank
from verify.execution.mutants import applied
from verify.execution.runner import Runner
from verify.properties.verdict import PropertyVerdict, flag

CHECK = "verify.properties.double_backward:check_double_backward"
# Both must appear in the refusal: what is unsupported and the switch that asks for it.
REFUSAL_WORDS = ("double backward", "create_graph")
# Central differences in fp64 err by truncation ~ h^2 |third derivative| plus the rounding of
# the two probes over 2h, which grows as h shrinks: no one step serves every case. On the H100
# nightly of 2026-11-25, softcapped fp32 cases in the offset regime (the CPU replays the same)
# had h = 1e-6 off by 1.2e-10 = 2.5e-5 of a v.H.u of 4.8e-6 (rounding: 1e-7 was off by 2.5e-4),
# while 1e-5 and 1e-4 agreed with the double backward to 1e-6. So the steps below are tried in
# turn and the check passes at the first that agrees within SECOND_ORDER_RTOL; a wrong second
# order disagrees at all of them (a silent zero misses by 100%).
FD_STEPS = (1e-5, 1e-4, 1e-6)
SECOND_ORDER_RTOL = 1e-5


def double_backward(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """Second-order gradients match finite differences (fp64) where supported, else refused."""
    return runner.run_check(CHECK, spec)


def check_double_backward(
    spec: CaseSpec, adapter: Adapter, mutant: str | None, rank: Rank
) -> list[PropertyVerdict]:
    """The verdicts of both paths (per-token outputs, the spec's loss) on ``rank.device``."""
    problem = build(spec)
    supported = spec.backend in (adapter.capabilities.double_backward or ())
    # Where it is claimed, checked in fp64; elsewhere (lce's Triton computes in fp32 at most)
    # for its refusal, on the spec's dtypes.
    dtype = torch.float64 if supported else problem.weight.dtype
    device = torch.device(rank.device)
    leaves = tuple(
        t.detach().to(device, dtype).requires_grad_()
        for t in (problem.hidden, problem.weight, problem.bias)
        if t is not None
    )  # hidden, weight and the bias (when the head has one)
    targets = problem.targets.to(device)
    options = spec.logit_options(effective_temperature(spec))

    def call(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> Call:
        return Call(
            h, w, targets, problem.ignore_index, options, backend=spec.backend,
            chunk_size=spec.chunk_size, bias=b,
        )  # fmt: skip

    ref = materialized(targets, problem.ignore_index, options)
    paths: list[tuple[str, Callable[..., Any], Callable[..., Any]]] = []
    if adapter.token_outputs is not None:
        names = [n for n in ("logprobs", "entropy") if n in adapter.outputs]
        tokens = adapter.token_outputs
        paths.append((
            "token_outputs", lambda *xs: tuple(tokens(call(*xs))[n] for n in names),
            lambda *xs: tuple(ref(*xs)[n] for n in names),
        ))  # fmt: skip
    if adapter.loss is not None:
        loss = adapter.loss
        paths.append((
            f"loss_{spec.reduction}", lambda *xs: loss(call(*xs), spec.reduction),
            lambda *xs: ref(*xs)["loss_" + spec.reduction],
        ))  # fmt: skip
    with applied(mutant):
        return [
            _check(spec, path, fn, leaves, must_work=supported, reference=reference)
            for path, fn, reference in paths
        ]


def materialized(
    targets: torch.Tensor, ignore_index: int, options: LogitOptions
) -> Callable[..., dict[str, torch.Tensor]]:
    """The spec's outputs from materialized logits in plain torch ops (fp64 leaves in, autograd
    all the way): the oracle the double backward is held to where central differences cannot
    settle it (`_check`). Per-token log-probs and entropy; the loss with its options' terms,
    reduced each way (a mean over the valid tokens)."""

    def outputs(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> dict:
        a = h.reshape(-1, h.shape[-1]) @ w.T
        a = (a if b is None else a + b) * options.logit_scale
        if options.softcap is not None:
            a = options.softcap * torch.tanh(a / options.softcap)
        z = a / options.temperature
        log_p = torch.log_softmax(z, dim=-1)
        y = targets.reshape(-1)
        valid = y != ignore_index
        picked = log_p.gather(1, torch.where(valid, y, 0)[:, None]).squeeze(1)
        logprobs = torch.where(valid, picked, 0.0)
        entropy = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
        eps = options.label_smoothing
        token = (eps - 1.0) * logprobs - eps * log_p.mean(-1)
        token = token + options.z_loss * torch.logsumexp(z, dim=-1).square()
        token = torch.where(valid, token, 0.0)
        shape = targets.shape
        return {
            "logprobs": logprobs.view(shape), "entropy": entropy.view(shape),
            "loss_none": token.view(shape), "loss_sum": token.sum(),
            "loss_mean": token.sum() / valid.sum(),
        }  # fmt: skip

    return outputs


def _check(
    spec: CaseSpec,
    path: str,
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    inputs: tuple[torch.Tensor, ...],
    *,
    must_work: bool,
    reference: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
) -> PropertyVerdict:
    output = f"double_backward_{path}"
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    try:
        torch.autograd.grad(sum(o.sum() for o in outputs), inputs, create_graph=True)
    except RuntimeError as error:
        message = str(error)
        named = all(word in message for word in REFUSAL_WORDS)
        ok = named and not must_work
        return flag("double_backward", spec, output, ok, f"refused: {message[:200]}")
    if not all(bool(o.isfinite().all()) for o in outputs):  # a mean over no valid token: NaN
        return flag("double_backward", spec, output, True, "non-finite outputs: not checked")
    if inputs[0].dtype != torch.float64:
        detail = "returned second-order terms that fp32 cannot check (refusal expected)"
        return flag("double_backward", spec, output, False, detail)
    try:
        analytic, central_difference = _second_order(fn, inputs, spec.seed)
    except RuntimeError as error:  # first-order gradients with no graph behind them
        return flag("double_backward", spec, output, False, f"no second order: {error}"[:200])
    tried = []
    for step in FD_STEPS:
        tried.append((step, central_difference(step)))
        agrees = abs(analytic - tried[-1][1]) <= SECOND_ORDER_RTOL * abs(tried[-1][1]) + 1e-12
        if agrees:
            break
    detail = f"v.H.u by double backward {analytic:.6g}, by central differences " + ", ".join(
        f"{n:.6g} (step {h:g})" for h, n in tried
    )
    if not agrees:  # differences that cancel to a tiny v.H.u: the materialized oracle decides
        oracle, _ = _second_order(reference, inputs, spec.seed)
        agrees = abs(analytic - oracle) <= SECOND_ORDER_RTOL * abs(oracle) + 1e-12
        detail += f"; by the materialized logits' double backward {oracle:.6g}"
    return flag("double_backward", spec, output, agrees, detail)


def _second_order(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    inputs: tuple[torch.Tensor, ...],
    seed: int,
) -> tuple[float, Callable[[float], float]]:
    """``v . d/dx[grad(g . fn)] . u`` for random g, u, v: by a double backward, and by central
    differences of first-order gradients along u (gradgradcheck's idea along one direction: a few
    runs instead of one per input element), the latter as a function of the step."""
    gen = torch.Generator().manual_seed(seed)

    def like(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)

    def outputs(xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        out = fn(*xs)
        return out if isinstance(out, tuple) else (out,)

    upstream = [like(o) for o in outputs(inputs)]
    u, v = [like(x) for x in inputs], [like(x) for x in inputs]

    def probe(xs: tuple[torch.Tensor, ...], create_graph: bool) -> torch.Tensor:
        grads = torch.autograd.grad(outputs(xs), xs, upstream, create_graph=create_graph)
        return sum((g * w).sum() for g, w in zip(grads, v, strict=True))

    hessian_v = torch.autograd.grad(probe(inputs, True), inputs)
    analytic = sum((h * d).sum() for h, d in zip(hessian_v, u, strict=True)).item()

    def central_difference(step: float) -> float:
        ends = [
            probe(
                tuple(
                    (x + sign * step * d).detach().requires_grad_()
                    for x, d in zip(inputs, u, strict=True)
                ),
                False,
            )
            for sign in (1.0, -1.0)
        ]
        return ((ends[0] - ends[1]) / (2 * step)).item()

    return analytic, central_difference
