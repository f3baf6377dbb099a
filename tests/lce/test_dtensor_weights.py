"""DTensor weights on real gloo meshes of 2 and 4 ranks, and FSDP2 models on 2 (`lce.dtensor`).

A Shard(0) DTensor weight must run exactly the TP path (``tp_group=``, ``vocab_start=``): the same
bits, forward and gradients, on both backends, uneven and empty shards included. The jobs live in
tests/helpers/dtensor_jobs.py and run on every rank of the pool's TP group.
"""

from __future__ import annotations

import pytest

from tests.helpers.checks import BACKENDS
from verify.distributed import WorkerPool
from verify.numerics.tolerances import load

JOBS = "tests.helpers.dtensor_jobs"


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(world_size=4, timeout_s=120) as workers:
        yield workers


# V = 37 splits unevenly (19/18 at 2 ranks, 10/10/10/7 at 4); V = 3 leaves rank 3 of 4 no rows.
# The Triton kernels run interpreted on the CPU, in fp32 (they compute in fp32 at most).
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("vocab", [37, 3])
@pytest.mark.parametrize(
    ("backend", "dtype"),
    [
        pytest.param("torch", "fp64", id="torch-fp64"),
        pytest.param("torch", "fp32", id="torch-fp32"),
        pytest.param("triton", "fp32", id="triton-fp32", marks=BACKENDS[1].marks),
    ],
)
def test_shard0_runs_the_tp_path_bit_for_bit(pool, tp, vocab, backend, dtype):
    payload = {"seed": 3, "vocab": vocab, "backend": backend, "dtype": dtype}
    results = pool.run(f"{JOBS}:shard0_equals_tp", payload, tp=tp)
    assert [r["differ"] for r in results] == [[]] * tp, results
    for result in results:
        assert result["placements"] == ["(Shard(dim=0),)"] * 3  # the gradient's placement
    rows = [r["rows"] for r in results]
    assert rows[0][0] == 0 and rows[-1][1] == vocab  # the shards tile the vocabulary
    if vocab == 3 and tp == 4:
        assert rows[-1] == (3, 3), "the case must include an empty shard"


def test_a_replicated_weight_runs_locally(pool):
    results = pool.run(f"{JOBS}:replicate_runs_locally", {"seed": 4}, tp=2)
    for result in results:
        assert result["differ"] == [] and result["placements"] == ["(Replicate(),)"] * 3


@pytest.mark.parametrize("tp", [2, 4])
def test_other_layouts_and_dtensor_activations_are_refused_by_name(pool, tp):
    expected = {
        "shard1": "ValueError: weight is a DTensor with placements (Shard(dim=1),) on a 1-D",
        "partial": "ValueError: weight is a DTensor with placements (Partial(sum),)",
        "dtensor_hidden": "TypeError: hidden is a DTensor (placements (Shard(dim=0),))",
        "dtensor_targets": "TypeError: targets is a DTensor (placements (Replicate(),))",
        "tp_group_too": "ValueError: weight is a DTensor: its device mesh gives the TP group",
        "plain_buffer": "ValueError: with a DTensor weight (placements (Shard(dim=0),)), "
        "grad_weight_into must be a DTensor",
        "dtensor_buffer_plain_weight": "ValueError: grad_weight_into is a DTensor but weight",
        # Agreed before the tokens are compared: a collective of another size would hang.
        "tokens_differ": "ValueError: the ranks of the TP group passed different token counts",
    }
    if tp == 4:
        expected["mesh_2d"] = (
            "ValueError: weight is a DTensor with placements (Shard(dim=0), Replicate()) on a 2-D"
        )
    for errors in pool.run(f"{JOBS}:refusals", {"seed": 5}, tp=tp):
        assert set(errors) == set(expected)
        for case, start in expected.items():
            assert errors[case].startswith(start), (case, errors[case])
        assert "redistribute" in errors["shard1"] and "full_tensor()" in errors["dtensor_hidden"]


def test_fsdp2_sharded_head_of_data_parallel_ranks_is_refused_with_the_fix(pool):
    """FSDP2 shards on dim 0 over a data-parallel mesh: taken as vocab-parallel it would mix the
    ranks' different tokens. Every rank raises, naming FSDP's own gather."""
    for result in pool.run(f"{JOBS}:fsdp2_loss", {"mode": "separate"}, tp=2):
        assert "ranks passed different hidden or targets" in result["error"]
        assert "model.lm_head.unshard()" in result["error"]


@pytest.mark.parametrize("mode", ["unshard", "root"])
def test_fsdp2_gathered_head_gives_the_unsharded_models_loss_and_gradients(pool, mode):
    """The documented fix (``unshard()``) and the head in the root unit: bit for bit the plain
    model's loss and its gradients averaged over the ranks (FSDP's mean; with 2 ranks every sum
    is of two terms and the division by 2 exact, so no rounding can differ)."""
    for result in pool.run(f"{JOBS}:fsdp2_loss", {"mode": mode}, tp=2):
        assert result["error"] == ""
        assert {name: err for name, (err, _) in result["errors"].items() if err} == {}
        assert result["resharded"], "FSDP reshards the head after backward"


def test_fsdp2_ranks_with_the_same_tokens_run_vocab_parallel(pool):
    """Same tokens on every rank: data-parallel and vocab-parallel readings agree, lce runs the
    latter. Only the order of the sums over the shards differs from the plain model: within the
    fp64 bound the harness grants an invariance that only reorders sums."""
    bound = load().exact["invariance_fp64"]
    for result in pool.run(f"{JOBS}:fsdp2_loss", {"mode": "same_tokens"}, tp=2):
        assert result["error"] == ""
        for name, (err, scale) in result["errors"].items():
            assert err <= bound * scale, (name, err, scale)
        assert result["errors"]["loss"][1] > 0
