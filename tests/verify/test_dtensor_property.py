"""DTensor weights in the harness: `CaseSpec.dtensor` cases built as DTensor leaves on a mesh over
the pool's gloo TP group (TP 1/2/4), the dtensor property (bit for bit against the plain tensors
the layout implies, gradients a DTensor of the leaf's placement), its two planted bugs, and an
implementation that does not claim DTensor weights getting them listed as not claimed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from verify.adapters.features import coerce, unclaimed
from verify.adapters.registry import resolve
from verify.cases.spec import DTENSOR_LAYOUTS, CaseSpec, SpecError, chunk_sizes
from verify.cases.strategies import case_specs
from verify.distributed import WorkerPool
from verify.execution.runner import Runner
from verify.properties.catalog import applicable
from verify.running.engine import check_case, run_property
from verify.running.pairwise import plan_slice
from verify.running.selftest import SELFTEST_PAIRS

# Uneven torch.chunk rows with an empty last shard at TP 4 (3, 3, 3, 0), a bias sharded with
# them, a strided weight, a partial grad_hidden, a second backward, bf16.
SPECS = [
    CaseSpec(tp=4, vocab=9, tokens=6, dtensor="shard0", bias=0.5, layout="sliced",
             reduce_hidden=False, target="edges"),
    CaseSpec(tp=2, vocab=9, tokens=5, dtensor="shard0", grads="twice", hidden_dtype="bf16",
             weight_dtype="bf16", loss_path="fast", reduction="sum"),
    CaseSpec(tp=2, vocab=7, tokens=5, dtensor="replicate", bias=0.5, layout="transposed",
             ignore="random"),
    CaseSpec(tp=1, vocab=13, tokens=4, dtensor="shard0", grads="weight", softcap=5.0),
]  # fmt: skip


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(world_size=4, timeout_s=120) as workers:
        yield workers


def _failed(verdicts) -> list[str]:
    return [v.line() for v in verdicts if not v.passed]


@pytest.mark.parametrize("spec", SPECS, ids=["shard0-tp4-empty", "shard0-tp2-fast-bf16",
                                             "replicate-tp2", "shard0-tp1"])  # fmt: skip
def test_dtensor_cases_pass_every_property(pool, spec):
    verdicts = check_case(spec, runner=Runner(pool))
    assert not _failed(verdicts), _failed(verdicts)
    outputs = {v.output for v in verdicts if v.property == "dtensor"}
    assert {"logprobs", "grad_placement"} <= outputs, outputs
    if spec.grads != "weight":
        assert "grad_hidden" in outputs


def test_a_search_drawing_dtensor_weights_passes(pool):
    names = ("differential", "contract", "dtensor", "tp_invariance")
    specs = case_specs(tp_sizes=(1, 2, 4), pairs=SELFTEST_PAIRS, dtensors=DTENSOR_LAYOUTS)
    result = run_property(names, strategy=specs, runner=Runner(pool), max_examples=12)
    assert result.passed and result.examples > 0, [v.line() for v in result.failure]


@pytest.mark.parametrize(
    ("mutant", "spec", "caught"),
    [
        ("dtensor_grad_partial", SPECS[0], {("dtensor", "grad_placement")}),
        ("dtensor_grad_plain", SPECS[3], {("dtensor", "grad_placement")}),
        ("dtensor_replicate_as_shard", SPECS[2], {("differential", "logprobs")}),
    ],
)
def test_planted_dtensor_bugs_fail(pool, mutant, spec, caught):
    """A Partial or plain gradient keeps every value right (only its layout is wrong; autograd
    takes a plain one where the shapes agree, at TP = 1); a replicated head run vocab-parallel
    counts the vocabulary once per rank."""
    failed = {(v.property, v.output) for v in check_case(spec, runner=Runner(pool, mutant))}
    failed = {pair for pair in failed if pair in caught or pair[0] == "dtensor"}
    assert caught <= failed, failed


def test_an_implementation_not_claiming_them_gets_them_listed():
    lce_torch = resolve("lce-torch")
    plain = replace(
        lce_torch, capabilities=replace(lce_torch.capabilities, dtensor_weights=("replicate",))
    )
    assert coerce(plain, SPECS[0]).dtensor == "none"
    assert coerce(plain, SPECS[2]) == SPECS[2]
    gaps = [g.line() for g in unclaimed(plain, (1, 2))]
    assert "DTensor weights ['shard0']: not claimed by the adapter" in gaps
    nothing = replace(lce_torch, capabilities=replace(lce_torch.capabilities, dtensor_weights=()))
    _, untested = applicable(nothing, (1, 2))
    assert {u.what: u.reason for u in untested}["property dtensor"] == "DTensor weights not claimed"
    record = plan_slice(plain, "torch", 2, ("differential", "dtensor")).record()
    assert {"value": "dtensor=shard0", "reason": "not claimed"} in record["not_claimed"]
    assert "dtensor" in record["features"] and "replicate" in record["features"]["dtensor"]


def test_shard0_rows_are_torch_chunks_and_the_spec_says_what_it_does_not_model():
    for vocab, tp in [(9, 4), (17, 4), (9, 2), (8, 4), (5, 3), (2, 2)]:
        rows = [len(c) for c in torch.arange(vocab).chunk(tp)]
        assert chunk_sizes(vocab, tp) == tuple(rows + [0] * (tp - len(rows)))
    assert CaseSpec(tp=4, vocab=9, dtensor="shard0").shard_bounds()[-1] == (9, 9)
    for bad in ({"tied": True, "tp": 1}, {"loss_path": "main_grad"}, {"shards": (5, 4)},
                {"dtensor": "replicate", "reduce_hidden": False}):  # fmt: skip
        fields = {"tp": 2, "vocab": 9, "dtensor": "shard0", **bad}
        with pytest.raises(SpecError, match="dtensor="):
            CaseSpec(**fields)
    # specs saved before the field existed keep their JSON
    assert "dtensor" not in CaseSpec().to_json()
    assert CaseSpec.from_json(SPECS[0].to_json()) == SPECS[0]
