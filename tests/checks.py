"""The one assertion shape of the core tests: kernel K, reference R and baseline B, per output.

Tolerances come from tolerances.yaml (their reasons live there), never from the test.
"""

from __future__ import annotations

import torch

from verify.numerics.compare import compare
from verify.numerics.reference import Reference, baseline, reference
from verify.numerics.tolerances import dtype_key, load


def reference_and_baseline(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
) -> tuple[Reference, Reference]:
    kwargs = dict(
        ignore_index=-100,
        temperature=temperature,
        grad_logprob=grad_logprob,
        grad_entropy=grad_entropy,
    )
    return reference(hidden, weight, targets, **kwargs), baseline(hidden, weight, targets, **kwargs)


def assert_outputs_match(
    kernel: dict[str, torch.Tensor],
    ref: Reference,
    base: Reference,
    hidden_dtype: torch.dtype,
    weight_dtype: torch.dtype,
) -> None:
    """Every output in ``kernel`` (named like `Reference` fields) passes its tolerance entry."""
    assert_within_tolerance(
        {name: (value, getattr(ref, name), getattr(base, name)) for name, value in kernel.items()},
        hidden_dtype,
        weight_dtype,
    )


def assert_within_tolerance(
    triples: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    hidden_dtype: torch.dtype,
    weight_dtype: torch.dtype,
) -> None:
    """``{output: (K, R, B)}``: each K passes the tolerance entry of its output and dtype."""
    key = dtype_key(hidden_dtype, weight_dtype)
    tolerances = load()
    failures = []
    for output, (kernel, ref, base) in triples.items():
        verdict = compare(output, kernel, ref, base, tolerances.get(key, output))
        if not verdict.passed:
            failures.append(f"{key} {output}: {verdict.detail}")
    assert not failures, "\n".join(failures)
