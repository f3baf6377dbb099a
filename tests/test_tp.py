"""Vocab-parallel TP over real gloo groups: TP=2 and TP=4 equal TP=1, on every backend."""

from __future__ import annotations

import pytest
import torch

from tests.checks import assert_outputs_match, assert_within_tolerance, reference_and_baseline
from tests.problems import make_problem
from tests.test_core import BACKENDS
from tests.tp_jobs import DTYPES, LOSS_GRAD
from verify.distributed import WorkerError, WorkerPool
from verify.numerics.compare import compare
from verify.numerics.reference import loss_upstream_grad
from verify.numerics.tolerances import load

JOB = "tests.tp_jobs:run_tp_case"


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(world_size=4, timeout_s=120) as workers:
        yield workers


def run(pool, tp, sizes, **case):
    payload = dict(seed=11, T=33, H=24, dtype="fp32", temperature=0.8, explicit_start=False)
    payload.update(case)
    payload["V"] = sum(sizes)
    payload["sizes"] = sizes
    results = pool.run(JOB, payload, tp=tp)
    merged = {key: value for key, value in results[0].items() if key != "grad_weight"}
    merged["grad_weight"] = torch.cat([r["grad_weight"] for r in results])
    return merged


def even(vocab: int, tp: int) -> list[int]:
    return [vocab // tp] * tp


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tp_equals_tp1_under_the_reference_tolerance(pool, backend, dtype):
    # V = 96: shards of 48 / 24 rows, default vocab_start; random targets land on every rank.
    tp1 = run(pool, 1, [96], backend=backend, dtype=dtype)
    problem = make_problem(33, 24, 96, DTYPES[dtype], seed=11)
    ref, base = reference_and_baseline(
        problem.hidden,
        problem.weight,
        problem.targets,
        0.8,
        problem.grad_logprob,
        problem.grad_entropy,
    )
    owners = problem.targets[problem.targets >= 0] // 24
    assert set(owners.tolist()) == {0, 1, 2, 3}, "targets must live on every TP=4 rank"
    for tp in (1, 2, 4):
        tpk = run(pool, tp, even(96, tp), backend=backend, dtype=dtype)
        # Same tolerance as TP=1 vs the reference, no looser.
        assert_outputs_match(tpk, ref, base, DTYPES[dtype], DTYPES[dtype])
        # Versus TP=1 directly, the same envelope: only the order of sums changes.
        tolerances = load()
        for name, value in tpk.items():
            verdict = compare(name, value, tp1[name], None, tolerances.get(dtype, name))
            assert verdict.passed, f"TP={tp} vs TP=1 {name}: {verdict.detail}"


@pytest.mark.parametrize("sizes", [[25, 24, 24, 24], [40, 1, 31, 25], [97, 0]])
def test_uneven_shards_with_vocab_start_are_exact_in_fp64(pool, sizes):
    tp1 = run(pool, 1, [sum(sizes)], backend="torch", dtype="fp64")
    tpk = run(pool, len(sizes), sizes, backend="torch", dtype="fp64", explicit_start=True)
    bound = load().exact["invariance_fp64"]  # only summation order differs
    for name, value in tpk.items():
        assert (value - tp1[name]).abs().max() <= bound * tp1[name].abs().max(), name


def test_uneven_shards_without_vocab_start_raise_a_clear_error(pool):
    with pytest.raises(WorkerError, match="pass vocab_start"):
        run(pool, 4, [25, 24, 24, 24], backend="torch")


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_scalar_loss_path_tp_equals_tp1_and_reference(pool, reduction):
    problem = make_problem(33, 24, 96, torch.float32, seed=11)
    upstream = loss_upstream_grad(
        problem.targets != -100, reduction, torch.tensor(LOSS_GRAD, dtype=torch.float64)
    )
    ref, base = reference_and_baseline(
        problem.hidden, problem.weight, problem.targets, 0.8, upstream, None
    )
    tp1 = run(pool, 1, [96], backend="torch", reduction=reduction)
    for tp in (2, 4):
        tpk = run(pool, tp, even(96, tp), backend="torch", reduction=reduction)
        triples = {
            "loss": (tpk["loss"], ref.loss(reduction), base.loss(reduction)),
            "grad_hidden": (tpk["grad_hidden"], ref.grad_hidden, base.grad_hidden),
            "grad_weight": (tpk["grad_weight"], ref.grad_weight, base.grad_weight),
        }
        assert_within_tolerance(triples, torch.float32, torch.float32)
        tolerances = load()
        for name, value in tpk.items():
            verdict = compare(name, value, tp1[name], None, tolerances.get("fp32", name))
            assert verdict.passed, f"TP={tp} vs TP=1 {name}: {verdict.detail}"
