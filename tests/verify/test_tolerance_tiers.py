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


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float64)


def test_fp16_partials_summed_across_ranks_may_lose_a_subnormal_step_each() -> None:
    """Found by a ci campaign (seed 101, fp16, TP=4, sequence parallel, peaked rows): grad_hidden
    near 1e-4 is summed from 4 partials, each rounded to fp16 on its rank, where fp16's absolute
    spacing is the smallest subnormal (6e-8) whatever the magnitude of the whole; B rounds once.
    Each rounding may lose half a step (3e-8), which no relative term grants (1.14x before)."""
    gen = torch.Generator().manual_seed(0)
    # Below fp16's smallest normal (6.1e-5), where every rounding is absolute: B's too; ~2e-6, so
    # that the floor (u max|R| ~ 3e-9) does not cover the half steps (3e-8) itself.
    ref = torch.randn(64, 8, generator=gen, dtype=torch.float64) * 2e-6
    shares = torch.randn(4, 64, 8, generator=gen, dtype=torch.float64) * 2e-6
    shares[-1] = ref - shares[:-1].sum(0)  # partials that cancel to ref, as ranks' do
    kernel = sum(_fp16(share) for share in shares).half()  # returned in fp16, like the ranks' sum
    base = _fp16(ref)
    tol = load().get("fp16", "grad_hidden")
    sequence_parallel = CaseSpec(
        tp=4, reduce_hidden=False, hidden_dtype="fp16", weight_dtype="fp16"
    )
    check = tolerance_check("p", sequence_parallel, "grad_hidden", kernel, ref, base, tol)
    assert check.passed, check.line()
    # Held to one rounding (the partials not counted) the same result fails: the term is needed.
    reduced = sequence_parallel.with_(reduce_hidden=True)
    assert not tolerance_check("p", reduced, "grad_hidden", kernel, ref, base, tol).passed
    # A real error of 8 steps on one element still fails.
    wrong = kernel.clone()
    wrong[5, 3] += 8 * 2.0**-24  # 8 subnormal steps
    assert not tolerance_check("p", sequence_parallel, "grad_hidden", wrong, ref, base, tol).passed
