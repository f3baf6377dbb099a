"""Double backward (a backward with ``create_graph=True``): right, or refused with a clear error.

lce's contract: the torch backend's per-token outputs without TP support it (gradgradcheck in
float64); every other path raises a RuntimeError naming double backward and ``create_graph``.
A path that does neither (returns second-order terms without being right) fails, whatever the
backend: a silent zero was the bug this property was written for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import lce
from verify.cases.build import IGNORE_INDEX, build
from verify.cases.spec import CaseSpec
from verify.execution.runner import Runner
from verify.properties.verdict import PropertyVerdict, flag

# Both must appear in the refusal: what is unsupported and the switch that asks for it.
REFUSAL_WORDS = ("double backward", "create_graph")


def double_backward(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """Second-order gradients pass gradgradcheck (fp64) where supported, else a clear error."""
    if spec.tp > 1 or spec.fault != "none" or runner.adapter.name != "lce":
        return []
    from verify.running.mutants import applied  # planted bugs patch lce: self-tests only

    problem = build(spec)
    # Triton computes in fp32 at most: it is checked for its refusal, on the spec's dtypes.
    dtype = torch.float64 if spec.backend == "torch" else problem.weight.dtype
    hidden, weight = (
        t.detach().to(dtype).requires_grad_() for t in (problem.hidden, problem.weight)
    )
    options = dict(
        ignore_index=IGNORE_INDEX, temperature=spec.temperature, backend=spec.backend,
        chunk_size=spec.chunk_size,
    )  # fmt: skip

    def tokens(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(lce.token_logprobs(h, w, problem.targets, **options))

    def loss(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return lce.linear_cross_entropy(h, w, problem.targets, reduction=spec.reduction, **options)

    supported = spec.backend == "torch"
    with applied(runner.mutant):
        return [
            _check(spec, "token_outputs", tokens, (hidden, weight), must_work=supported),
            _check(spec, f"loss_{spec.reduction}", loss, (hidden, weight), must_work=False),
        ]


def _check(
    spec: CaseSpec,
    path: str,
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    inputs: tuple[torch.Tensor, torch.Tensor],
    *,
    must_work: bool,
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
    # fast_mode: finite differences along random directions, not per element (cheap at any size).
    ok = torch.autograd.gradgradcheck(fn, inputs, fast_mode=True, raise_exception=False)
    return flag("double_backward", spec, output, ok, "gradgradcheck (fp64, fast mode)")
