"""Vocab-parallel TP over real gloo groups: TP=2 and TP=4 equal TP=1, on every backend.

Every case is a `CaseSpec` run by the harness's one execution path (`Runner` -> pool ->
`verify.execution.execute`), so the shards, the upstream gradients and the reference are the
campaign's own.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.checks import BACKENDS
from verify.cases.build import build
from verify.cases.spec import CaseSpec
from verify.distributed import WorkerError, WorkerPool
from verify.execution.outcome import TOLERANCE_OUTPUT
from verify.execution.runner import Runner
from verify.numerics.compare import compare
from verify.numerics.reference import IGNORE_INDEX
from verify.numerics.tolerances import load
from verify.properties.oracle import oracle

# V = 96: shards of 48 / 24 rows. Random ignored tokens, random upstream gradients on logprobs and
# entropy, a scalar loss upstream of -1.25 (not 1), chunks of 8 tokens.
SPEC = CaseSpec(
    tokens=33, hidden_size=24, vocab=96, temperature=0.8, scale=3.0, ignore="random",
    reduction="sum", chunk_size=8, seed=11,
)  # fmt: skip


@pytest.fixture(scope="module")
def runner():
    with WorkerPool(world_size=4, timeout_s=120) as workers:
        yield Runner(workers)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_tp_equals_tp1_under_the_reference_tolerance(runner, backend, dtype, reduction):
    spec = SPEC.with_(backend=backend, hidden_dtype=dtype, weight_dtype=dtype, reduction=reduction)
    targets = build(spec).targets
    owners = targets[targets != IGNORE_INDEX] // 24
    assert set(owners.tolist()) == {0, 1, 2, 3}, "targets must live on every TP=4 rank"
    tolerances = load()
    tp1 = runner.run(spec)
    ref, base = oracle(spec).ref, oracle(spec).base
    for tp in (1, 2, 4):
        run = runner.run(spec.with_(tp=tp))
        assert run.status == "ok", run.error
        # token outputs and the loss path (no bias in SPEC: no bias gradients)
        assert set(run.outputs) == {n for n in TOLERANCE_OUTPUT if not n.endswith("bias")}
        for name, value in run.outputs.items():
            tol = tolerances.get(dtype, TOLERANCE_OUTPUT[name])
            # Same tolerance as TP=1 vs the reference, no looser.
            verdict = compare(name, value, ref[name], base[name], tol)
            assert verdict.passed, f"TP={tp} {name} vs R: {verdict.detail}"
            # Versus TP=1 directly, the same envelope: only the order of sums changes.
            verdict = compare(name, value, tp1.outputs[name], None, tol)
            assert verdict.passed, f"TP={tp} vs TP=1 {name}: {verdict.detail}"


@pytest.mark.parametrize("reduction", ["none", "sum"])
@pytest.mark.parametrize("shards", [(25, 24, 24, 24), (40, 1, 31, 25), (97, 0)])
def test_uneven_shards_with_vocab_start_are_exact_in_fp64(runner, shards, reduction):
    # The token path and the scalar-loss path (whose empty shard, (97, 0), returned before its
    # chunks' collectives and left rank 0 hanging).
    spec = SPEC.with_(
        vocab=sum(shards), hidden_dtype="fp64", weight_dtype="fp64", reduction=reduction
    )
    tp1 = runner.run(spec)
    tpk = runner.run(spec.with_(tp=len(shards), shards=shards))
    assert tpk.status == "ok", tpk.error
    bound = load().exact["invariance_fp64"]  # only summation order differs
    for name, value in tpk.outputs.items():
        single = tp1.outputs[name]
        assert (value - single).abs().max() <= bound * single.abs().max(), name


def test_uneven_shards_without_vocab_start_raise_a_clear_error(runner):
    spec = SPEC.with_(vocab=97, tp=4, shards=(25, 24, 24, 24))
    with pytest.raises(WorkerError, match="pass vocab_start"):
        runner.pool.run("tests.helpers.tp_jobs:without_vocab_start", spec.to_json(), tp=4)


def test_the_spec_says_the_shards():
    spec = CaseSpec(vocab=97, tp=4, shards=(40, 1, 31, 25))
    assert spec.shard_bounds() == [(0, 40), (40, 41), (41, 72), (72, 97)]
    assert not spec.even_shards
    assert CaseSpec(vocab=97, tp=4).shard_bounds()[0] == (0, 25)  # numpy.array_split sizes
    assert CaseSpec.from_json(spec.to_json()) == spec
    assert "shards" not in CaseSpec(vocab=97, tp=4).to_json()  # older artifacts keep their JSON
    with pytest.raises(ValueError, match="shards must be tp=4 sizes"):
        CaseSpec(vocab=97, tp=4, shards=(40, 1, 31))
    with pytest.raises(ValueError, match="summing to vocab=97"):
        CaseSpec(vocab=97, tp=4, shards=(40, 1, 31, 24))
    assert torch.equal(build(spec).weight, build(spec.with_(tp=1, shards=None)).weight)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("disagree", "message"),
    [
        ("tokens", "different token counts"),
        ("vocab_start", "only some ranks of the TP group passed vocab_start"),
        ("targets", "targets must have shape|another rank of the TP group rejected"),
    ],
)
def test_ranks_that_disagree_all_raise_a_clear_error(runner, backend, disagree, message):
    """Checked by one fixed-size collective before any per-token one: before it, a token-count
    mismatch was a gloo collective mismatch (SIGABRT) and a lone vocab_start a hang."""
    results = runner.pool.run(
        "tests.helpers.tp_jobs:run_disagreeing_call", dict(disagree=disagree, backend=backend), tp=4
    )
    errors = [r["error"] for r in results]
    assert all(re.search(message, e) for e in errors), errors
    if disagree != "targets":  # there the rank with bad targets says what is wrong with them
        assert len(set(errors)) == 1, errors


def test_double_backward_under_tp_raises_on_every_rank(runner):
    results = runner.pool.run("tests.helpers.tp_jobs:run_double_backward", {}, tp=2)
    assert all("double backward" in r["error"] and "TP" in r["error"] for r in results), results
