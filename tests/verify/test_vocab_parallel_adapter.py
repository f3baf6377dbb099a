"""A third party's vocab-parallel kernel through the harness at TP 2 over gloo: written as
Megatron's is, with its shard's first id from `Call.first_id` (None in `Call.vocab_start` on
equal shards means ``rank * V_local``, lce's own default), it passes, for a summed and a partial
grad_hidden alike; with the ownership test's off-by-one at the shard's end it fails."""

from __future__ import annotations

import pytest

from verify.adapters import resolve
from verify.adapters.features import coerce
from verify.cases.spec import CaseSpec
from verify.distributed import WorkerPool
from verify.execution.runner import Runner
from verify.running.engine import check_case

HELPERS = "tests.helpers.vocab_parallel_impl"
PROPERTIES = ["differential", "contract"]
# Equal shards (vocab_start None); targets at the shards' edges (each first and last id).
SPEC = CaseSpec(tokens=16, vocab=16, tp=2, target="edges", seed=2, upstream="logprob_only")


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(world_size=2) as workers:
        yield workers


def _failed(pool: WorkerPool, impl: str, spec: CaseSpec) -> set[str]:
    adapter = resolve(f"{HELPERS}:{impl}")
    fitted = coerce(adapter, spec)
    assert fitted.tp == 2 and fitted.reduce_hidden == spec.reduce_hidden  # nothing mapped away
    verdicts = check_case(fitted, properties=PROPERTIES, runner=Runner(pool, adapter=adapter))
    return {v.output for v in verdicts if v.failed}


@pytest.mark.parametrize("reduce_hidden", [True, False])
def test_a_vocab_parallel_kernel_passes_at_tp2(pool: WorkerPool, reduce_hidden: bool) -> None:
    spec = SPEC.with_(reduce_hidden=reduce_hidden)
    assert _failed(pool, "vocab_parallel", spec) == set()


def test_an_off_by_one_at_the_shard_end_fails(pool: WorkerPool) -> None:
    failed = _failed(pool, "shard_end_owned", SPEC)
    assert {"loss", "logprobs"} & failed, failed
