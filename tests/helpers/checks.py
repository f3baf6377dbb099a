"""The one assertion shape of the core tests: kernel K, reference R and baseline B, per output.

Tolerances come from tolerances.yaml (their reasons live there), never from the test.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import lce
from lce.options import LogitOptions
from verify.cases.build import Problem, build
from verify.cases.spec import CaseSpec
from verify.execution.outcome import TOLERANCE_OUTPUT
from verify.numerics.compare import compare
from verify.numerics.reference import IGNORE_INDEX, Reference, Upstream, baseline, reference
from verify.numerics.tolerances import dtype_key, load


def core_problem(
    tokens: int,
    hidden_size: int,
    vocab: int,
    seed: int,
    dtypes: tuple[str, str] = ("fp32", "fp32"),
    **fields,
) -> Problem:
    """The global problem of the `CaseSpec` the core tests use: random ignored tokens and logits
    of scale 3 on log-normal weight rows, unless ``fields`` say otherwise."""
    hidden_dtype, weight_dtype = dtypes
    fields = {"ignore": "random", "scale": 3.0, **fields}
    spec = CaseSpec(
        tokens=tokens, hidden_size=hidden_size, vocab=vocab, seed=seed,
        hidden_dtype=hidden_dtype, weight_dtype=weight_dtype, **fields,
    )  # fmt: skip
    return build(spec)


def reference_and_baseline(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    grad_loss: torch.Tensor | None = None,
) -> tuple[Reference, Reference]:
    """R and B of the plain head at ``temperature`` under these upstream gradients (``grad_loss``
    on the per-token losses, `verify.numerics.reference.loss_upstream_grad`)."""
    kwargs = dict(
        ignore_index=IGNORE_INDEX,
        options=LogitOptions(temperature=temperature),
        upstream=Upstream(grad_logprob, grad_entropy, grad_loss),
    )
    return reference(hidden, weight, targets, **kwargs), baseline(hidden, weight, targets, **kwargs)


def assert_outputs_match(
    kernel: dict[str, torch.Tensor],
    ref: Reference,
    base: Reference,
    hidden_dtype: str | torch.dtype,
    weight_dtype: str | torch.dtype,
) -> None:
    """Every output in ``kernel`` (named like `Reference` fields) passes its tolerance entry."""
    assert_within_tolerance(
        {name: (value, getattr(ref, name), getattr(base, name)) for name, value in kernel.items()},
        hidden_dtype,
        weight_dtype,
    )


def assert_within_tolerance(
    triples: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    hidden_dtype: str | torch.dtype,
    weight_dtype: str | torch.dtype,
) -> None:
    """``{output: (K, R, B)}``: each K passes the tolerance entry of its output and dtype (the
    harness's, `verify.execution.outcome.TOLERANCE_OUTPUT`: grad_bias is judged as a column of
    grad_weight)."""
    key = dtype_key(hidden_dtype, weight_dtype)
    tolerances = load()
    failures = []
    for output, (kernel, ref, base) in triples.items():
        entry = tolerances.get(key, TOLERANCE_OUTPUT.get(output, output))
        verdict = compare(output, kernel, ref, base, entry)
        if not verdict.passed:
            failures.append(f"{key} {output}: {verdict.detail}")
    assert not failures, "\n".join(failures)


BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("triton") is None, reason="triton is not installed"
        ),
    ),
]
DTYPES = {
    "fp32": ("fp32", "fp32"),
    "bf16": ("bf16", "bf16"),
    "fp16": ("fp16", "fp16"),
    "fp32_bf16": ("fp32", "bf16"),
}


def run_lce(problem, backend, temperature=1.0, chunk_size=8, **kwargs):
    hidden = problem.hidden.clone().requires_grad_()
    weight = problem.weight.clone().requires_grad_()
    out = lce.token_logprobs(
        hidden,
        weight,
        problem.targets,
        temperature=temperature,
        backend=backend,
        chunk_size=chunk_size,
        **kwargs,
    )
    return hidden, weight, out


def confident_problem(margins, hidden_size=16, vocab=50, offset=100.0, seed=3):
    """fp32 rows whose target leads every other logit by ``margins[i]`` on top of a common logit
    ``offset``: 1 - p_y is ~vocab * exp(-margin), far below fp32's resolution of 1.

    Column 0 of hidden is 1 and carries the offset; the other columns of the rows are orthogonal,
    so boosting one row's target moves no other row's logits.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = len(margins)
    basis, _ = torch.linalg.qr(
        torch.randn(hidden_size - 1, rows, generator=gen, dtype=torch.float64)
    )
    hidden = torch.cat([torch.ones(rows, 1, dtype=torch.float64), basis.T * 4.0], dim=1)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64) * 0.5
    weight[:, 0] = offset
    targets = torch.randperm(vocab, generator=gen)[:rows]
    for row, margin in enumerate(margins):
        z = hidden[row] @ weight.T
        lead = margin + (z.max() - z[targets[row]]).item()
        direction = hidden[row, 1:]
        weight[targets[row], 1:] += lead * direction / direction.dot(direction)
    upstream = torch.randn(2, rows, generator=gen)
    return hidden.float(), weight.float(), targets, upstream[0], upstream[1]
