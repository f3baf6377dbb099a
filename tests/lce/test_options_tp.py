"""The logit options under vocab-parallel TP over real gloo groups (TP = 2 and 4): the global
logsumexp in the z term, the smoothing mean over the whole (global) vocabulary, the bias sharded
with the weight and its gradient on each rank, on every path and both backends, against the
float64 formula of `option_reference`; the typical TP bug of each loss term (its statistic taken
over one rank's shard only) shown to fail the same tolerance."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.checks import BACKENDS
from tests.helpers.option_reference import (
    ALL_OPTIONS,
    assert_caught,
    assert_close,
    expected,
    make_problem,
    reference,
)
from verify.distributed import WorkerPool

# fp32, as the single-process option tests (test_loss_options.REL): the TP merge only reorders
# the softmax sums (one packed fp32 all-reduce), so the same bound holds at every TP degree.
REL = 1e-5
# V = 600: shards of 300 / 150 at TP 2 / 4; the uneven shards pass vocab_start (one of them a
# single row), so the global vocabulary's size comes from the merge, not from tp x V_local.
PROBLEM_ARGS = {"seed": 4, "tokens": 13, "vocab": 600}
PROBLEM = make_problem(**PROBLEM_ARGS)
UNEVEN = {2: [451, 149], 4: [200, 1, 250, 149]}


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(world_size=4, timeout_s=120) as workers:
        yield workers


def _run(pool, tp, backend, path, shards=None, options=ALL_OPTIONS):
    payload = {
        "problem": PROBLEM_ARGS, "shards": shards, "path": path, "backend": backend,
        "options": options, "with_bias": True,
    }  # fmt: skip
    results = pool.run("tests.helpers.option_jobs:run_options", payload, tp=tp)
    # Outputs and grad_hidden are replicated: every rank must hold the same values.
    for other in results[1:]:
        for mine, theirs in zip(results[0]["outputs"], other["outputs"], strict=True):
            assert torch.equal(mine, theirs)
        assert torch.equal(results[0]["grads"][0], other["grads"][0])
    grad_weight = torch.cat([r["grads"][1] for r in results])
    grad_bias = torch.cat([r["grads"][2] for r in results])
    return results[0]["outputs"], (results[0]["grads"][0], grad_weight, grad_bias)


def _check(outputs, grads, path, options=ALL_OPTIONS):
    ref = reference(PROBLEM, **options)
    objective, *want_outputs = expected(PROBLEM, path, ref)
    for index, (got, want) in enumerate(zip(outputs, want_outputs, strict=True)):
        assert_close(f"output {index}", got, want, REL)
    want_grads = ref.grads(objective)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, want_grads, strict=True):
        assert_close(f"grad_{name}", got, want, REL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["tokens", "default", "fast", "grad_weight_into"])
@pytest.mark.parametrize("tp", [2, 4])
def test_every_option_under_tp_matches_the_formula(pool, tp, path, backend):
    outputs, grads = _run(pool, tp, backend, path)
    _check(outputs, grads, path)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tp", [2, 4])
def test_uneven_shards_smooth_over_the_whole_vocabulary(pool, tp, backend):
    outputs, grads = _run(pool, tp, backend, "default", shards=UNEVEN[tp])
    _check(outputs, grads, "default")


def test_the_tolerance_catches_a_shard_local_z_term_or_smoothing_mean():
    """What a rank would compute from its own shard's logits: lse (in the z term) and the
    smoothing mean over ``[0, 150)`` only (rank 0 of TP 4). Each moves the loss and grad_weight
    by far more than REL."""
    for options in ({"z_loss": 0.05}, {"label_smoothing": 0.2}):
        ref = reference(PROBLEM, **options)
        planted = reference(PROBLEM, variant="local_vocab", local=slice(0, 150), **options)
        assert_caught(f"{options}: loss", planted.loss, ref.loss, REL)
        grads = [r.grads((PROBLEM.g_loss * r.loss).sum())[1] for r in (ref, planted)]
        assert_caught(f"{options}: grad_weight", grads[1], grads[0], REL)
