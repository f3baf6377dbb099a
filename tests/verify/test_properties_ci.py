"""The property engine's ``ci`` profile on the correct implementation: both backends, TP on a pool.

Every dtype pair, every input class of docs/DESIGN.md within `verify.cases.strategies.LOGIT_BOUND`.
"""

from __future__ import annotations

import pytest

from verify.cases.strategies import case_specs, invalid_specs
from verify.distributed import WorkerPool
from verify.execution.runner import Runner
from verify.properties.status import available_backends
from verify.running.engine import run_property
from verify.running.selftest import SELFTEST_PAIRS, selftest_specs

LOCAL_PROPERTIES = (
    "differential", "contract", "chunk_invariance", "vocab_permutation", "shift_invariance",
    "entropy_targets", "upstream_linearity", "ignored_rows", "tied_untied", "temperature",
    "reduction", "determinism", "torch_peer",
)  # fmt: skip


def _assert_passed(result) -> None:
    assert result.passed, "\n".join(v.line() for v in result.failure)
    assert result.examples > 0


def test_ci_profile_torch_backend() -> None:
    result = run_property(LOCAL_PROPERTIES, strategy=selftest_specs((1,)), profile="ci")
    _assert_passed(result)


@pytest.mark.skipif("triton" not in available_backends(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_ci_profile_triton_backend() -> None:
    # Few examples: the interpreter pays ~10 ms per kernel program step.
    specs = case_specs(backends=("triton",), pairs=SELFTEST_PAIRS, max_tokens=8)
    result = run_property(("differential", "contract"), strategy=specs, max_examples=10)
    _assert_passed(result)


def test_status_agreement_on_invalid_inputs() -> None:
    result = run_property("status", strategy=invalid_specs(), max_examples=8)
    _assert_passed(result)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(world_size=2, timeout_s=120) as workers:
        yield workers


def test_ci_profile_tensor_parallel(pool) -> None:
    runner = Runner(pool)
    specs = selftest_specs((2,))
    names = ("differential", "contract", "tp_invariance", "megatron_peer")
    result = run_property(names, strategy=specs, runner=runner, max_examples=10)
    _assert_passed(result)
