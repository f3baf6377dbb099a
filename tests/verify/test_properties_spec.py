"""Case specs: JSON round trip, clear errors, and tensors that depend on the spec alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from verify.cases.build import build
from verify.cases.rank_inputs import vocab_range
from verify.cases.spec import CaseSpec, SpecError
from verify.cases.strategies import case_specs, invalid_specs
from verify.properties.verdict import flag


@settings(max_examples=40, derandomize=True, database=None, deadline=None)
@given(case_specs(tp_sizes=(1, 2, 4)) | invalid_specs())
def test_spec_json_round_trip(spec: CaseSpec) -> None:
    line = spec.to_json()
    assert "\n" not in line
    assert CaseSpec.from_json(line) == spec


def test_unknown_field_and_bad_value_are_named() -> None:
    with pytest.raises(SpecError, match=r"unknown CaseSpec field\(s\) \['vocab_size'\]"):
        CaseSpec.from_json('{"vocab_size": 3}')
    with pytest.raises(SpecError, match="regime must be one of"):
        CaseSpec(regime="wild")
    with pytest.raises(SpecError, match="tied=True needs tp=1"):
        CaseSpec(tied=True, tp=2, vocab=4)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_shards_rebuild_the_same_global_problem(tp: int) -> None:
    base = CaseSpec(tokens=5, vocab=31, regime="peaked", hidden_dtype="bf16", weight_dtype="bf16")
    spec = base.with_(tp=tp)
    whole, sharded = build(base), build(spec)
    shards = [sharded.weight[slice(*vocab_range(spec, r))] for r in range(tp)]
    assert torch.equal(torch.cat(shards), whole.weight)  # uneven shards at tp=3 and 4
    assert torch.equal(sharded.hidden, whole.hidden)
    assert torch.equal(sharded.targets, whole.targets)


def test_same_spec_same_numbers_and_seed_changes_them() -> None:
    spec = CaseSpec(tokens=6, vocab=17, ignore="random", upstream="random")
    a, b, c = build(spec), build(spec), build(spec.with_(seed=1))
    assert torch.equal(a.hidden, b.hidden) and torch.equal(a.grad_logprob, b.grad_logprob)
    assert not torch.equal(a.hidden, c.hidden)


def test_regimes_reach_their_input_classes() -> None:
    # H >= V: every target can lead (with H < V only targets on the hull of weight's rows can).
    peaked = build(CaseSpec(tokens=8, vocab=17, hidden_size=33, regime="peaked"))
    logits = peaked.hidden.double() @ peaked.weight.double().T
    rows = torch.arange(8)
    target = logits[rows, peaked.targets].clone()
    logits[rows, peaked.targets] = -torch.inf
    assert bool((target - logits.max(1).values > 9.0).all())  # target leads by ~10
    negative = build(CaseSpec(tokens=8, vocab=16, regime="negative"))
    assert float((negative.hidden.double() @ negative.weight.double().T).max()) <= -100


def test_failure_line_names_property_output_numbers_and_spec() -> None:
    spec = CaseSpec(vocab=7)
    line = flag("contract", spec, "inputs", False, "inputs modified").line()
    assert line.startswith("contract FAILED on inputs [exact]: measured 1 vs allowed 0")
    assert line.endswith("spec=" + spec.to_json())
