"""The one assertion shape of the core tests: kernel K, reference R and baseline B, per output.

Tolerances come from tolerances.yaml (their reasons live there), never from the test.
"""

from __future__ import annotations

import torch

from verify.cases.build import Problem, build
from verify.cases.spec import CaseSpec
from verify.numerics.compare import compare
from verify.numerics.reference import IGNORE_INDEX, Reference, baseline, reference
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
) -> tuple[Reference, Reference]:
    kwargs = dict(
        ignore_index=IGNORE_INDEX,
        temperature=temperature,
        grad_logprob=grad_logprob,
        grad_entropy=grad_entropy,
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
    """``{output: (K, R, B)}``: each K passes the tolerance entry of its output and dtype."""
    key = dtype_key(hidden_dtype, weight_dtype)
    tolerances = load()
    failures = []
    for output, (kernel, ref, base) in triples.items():
        verdict = compare(output, kernel, ref, base, tolerances.get(key, output))
        if not verdict.passed:
            failures.append(f"{key} {output}: {verdict.detail}")
    assert not failures, "\n".join(failures)
