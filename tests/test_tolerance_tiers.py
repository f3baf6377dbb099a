"""The tolerance tiers of two runs that must agree (the metamorphic properties' `pair_check`)."""

from __future__ import annotations

import torch

from verify.cases.spec import CaseSpec
from verify.numerics.tolerances import load
from verify.properties.verdict import pair_check, tolerance_check

SPEC = CaseSpec()
TOL = load().get("fp32", "grad_weight")


def _ulp_noise(ref: torch.Tensor, ulps: float, seed: int) -> torch.Tensor:
    """``ref`` plus an error of ``ulps`` fp32 ulps of its largest element, random signs (the
    cancellation in ``p - onehot`` errs relative to 1, not to the small gradient)."""
    signs = torch.randint(0, 2, ref.shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return ref + signs * ulps * torch.finfo(torch.float32).eps * ref.abs().max()


def test_two_runs_that_each_pass_against_r_pass_as_a_pair() -> None:
    """Found on the documented example kernel (vocab_permutation, fp32 peaked landmark): both runs
    passed against R, but their distance was held to one run's bound scaled by the first problem's
    B, which rounded 4.5x better than B on the permuted problem. Here: B1 errs by 10 ulps, B2 by
    40, each run by as much as its B, so each passes alone and the pair differs by up to 50 ulps
    (the floor, 1e-6 of the largest element, is 8.4 ulps)."""
    ref = torch.randn(16, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    base1, base2 = _ulp_noise(ref, 10, 1), _ulp_noise(ref, 40, 2)
    run1, run2 = _ulp_noise(ref, 10, 3), _ulp_noise(ref, 40, 4)
    for run, base in ((run1, base1), (run2, base2)):
        assert tolerance_check("p", SPEC, "grad_weight", run, ref, base, TOL).passed
    base_error = (base1 - ref).abs() + (base2 - ref).abs()
    verdict = pair_check("p", SPEC, "grad_weight", run1, run2, base_error, TOL)
    assert verdict.passed, verdict.line()
    # One run's bound (B1's error alone) is what used to be checked: it fails the same pair.
    single = tolerance_check("p", SPEC, "grad_weight", run1, run2, run2 + (base1 - ref), TOL)
    assert not single.passed


def test_a_pair_apart_by_more_than_both_bounds_fails() -> None:
    """Two runs whose distance is a real bug (a row of grad_weight off by 1%) still fail."""
    ref = torch.randn(16, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    base = _ulp_noise(ref, 1, 1)
    run1, run2 = _ulp_noise(ref, 1, 3), _ulp_noise(ref, 1, 4)
    run2[3] *= 1.01
    base_error = 2 * (base - ref).abs()
    assert not pair_check("p", SPEC, "grad_weight", run1, run2, base_error, TOL).passed
