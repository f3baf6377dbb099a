"""The statistical tier (`verify.numerics.compare.statistical_tier`) sees one extra rounding of a
gradient that the per-element tiers pass: lce's fast loss with its saved bf16 gradient rounded
to the input dtype and then scaled there (TE #3193, the `grad_rounded_twice` mutant) fails it,
clean lce on the same cases passes it."""

from __future__ import annotations

import re
import time

import pytest
import torch

from verify.cases.spec import CaseSpec
from verify.execution.mutants import applied
from verify.numerics.compare import span_basis
from verify.properties.rounding_model import expected_dof
from verify.running.engine import check_case

# H = 64 and 6 tokens: ~300 degrees of freedom on grad_hidden and ~750 on grad_weight, above the
# tier's 256 (tolerances.yaml); a loss upstream other than 1 (sum over random-upstream tokens
# scaled by a random grad_loss) makes the scaling of the saved gradients a rounding of its own.
SPEC = CaseSpec(
    hidden_dtype="bf16", weight_dtype="bf16", tokens=6, hidden_size=64, vocab=13,
    loss_path="fast", upstream="random", reduction="sum",
)  # fmt: skip
DOUBLED = ("loss_grad_hidden", "loss_grad_weight")


def _statistical(verdicts) -> dict[str, object]:
    return {v.output: v for v in verdicts if v.output.endswith(("grad_hidden", "grad_weight"))}


@pytest.mark.parametrize("seed", [0, 1])
def test_the_tier_fails_a_double_rounded_gradient_and_passes_clean_lce(seed: int) -> None:
    spec = SPEC.with_(seed=seed)
    clean = _statistical(check_case(spec, properties=["differential"]))
    with applied("grad_rounded_twice"):
        doubled = _statistical(check_case(spec, properties=["differential"]))
    assert set(DOUBLED) <= set(clean), clean
    for verdict in clean.values():
        assert not verdict.failed, verdict.line()
        assert "statistical:" in verdict.detail, verdict.detail  # the tier judged it
    for name in DOUBLED:
        verdict = doubled[name]
        assert verdict.failed and verdict.tier == "statistical", verdict.line()
    # the per-token outputs the mutant does not touch pass with it
    assert not doubled["grad_hidden"].failed and not doubled["grad_weight"].failed


def test_expected_dof_estimates_what_the_tier_judges() -> None:
    """The planner's estimate (`expected_dof`) is the tier's own count but for the elements the
    accumulation's share leaves out: within 10% of it from above; 0 where the tier judges
    nothing (fp32 gradients, an empty batch), and a tied weight's gradient left out."""
    verdicts = _statistical(check_case(SPEC, properties=["differential"]))
    judged = [v for v in verdicts.values() if "statistical:" in v.detail]
    dofs = [float(re.search(r"rounding noise, (\d+) dof", v.detail)[1]) for v in judged]
    assert len(dofs) == 4, [v.line() for v in verdicts.values()]
    assert sum(dofs) <= expected_dof(SPEC) <= 1.1 * sum(dofs), (dofs, expected_dof(SPEC))
    assert expected_dof(SPEC.with_(hidden_dtype="fp32", weight_dtype="fp32")) == 0
    assert expected_dof(SPEC.with_(tokens=0)) == 0
    hidden_only = 2 * 6 * (64 - 13)  # grad_hidden and loss_grad_hidden: 6 rows, 13 in the span
    assert expected_dof(SPEC.with_(tied=True)) == hidden_only


def test_the_tier_costs_no_hidden_squared_memory_and_keeps_its_numbers() -> None:
    """At H = 4097 the tier works in ``r x r`` products of the span's basis (the ``[rows, H, H]``
    projectors it formed before took 1 GB and 15 s a case); its degrees of freedom, spread and
    measurement equal the projector's own on a small problem, masked elements and a
    rank-deficient span included."""
    torch.manual_seed(0)
    rows, width, rank = 3, 12, 4
    span = torch.randn(width, rank, dtype=torch.float64)
    span[:, -1] = span[:, 0]  # rank-deficient
    sigma = torch.rand(rows, width, dtype=torch.float64) + 0.1
    mask = (torch.rand(rows, width) > 0.3).to(torch.float64)
    basis = span_basis(span, sigma, mask)
    projector = torch.eye(width, dtype=torch.float64) - basis @ basis.transpose(1, 2)
    inside = basis * mask[:, :, None]
    dof = mask.sum() - inside.pow(2).sum()
    assert torch.isclose(dof, (torch.diagonal(projector, dim1=1, dim2=2) * mask).sum())
    spread = mask.sum() - 2 * inside.pow(2).sum() + (inside.transpose(1, 2) @ inside).pow(2).sum()
    masked = projector * mask[:, :, None] * mask[:, None, :]
    assert torch.isclose(spread, masked.pow(2).sum())
    error = torch.randn(rows, width, dtype=torch.float64) * mask
    off = error - (basis @ (basis.transpose(1, 2) @ error[:, :, None]))[..., 0]
    assert torch.isclose(off.pow(2).sum(), (projector @ error[:, :, None]).pow(2).sum())
    deep = SPEC.with_(hidden_size=4097, tokens=2, grads="weight", loss_path="default")
    started = time.perf_counter()
    verdicts = _statistical(check_case(deep, properties=["differential"]))
    assert "statistical:" in verdicts["grad_weight"].detail
    assert time.perf_counter() - started < 10.0
