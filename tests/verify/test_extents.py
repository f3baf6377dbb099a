"""Sizes past real kernels' tile and chunk boundaries (`verify.cases.spec.EXTENTS`): one dimension
at a time in the landmarks and the covering rows, left out (and said so) where Triton runs in its
interpreter, judged against R by the properties that hold one run to it, and a failure there
halved down to the first size past the boundary."""

from __future__ import annotations

import time

import pytest
import torch

from tests.helpers.tiled_impl import CHUNK
from verify.adapters.features import coerce
from verify.adapters.registry import resolve
from verify.cases import coverage
from verify.cases.build import tied_hidden
from verify.cases.spec import EXTENTS, CaseSpec
from verify.cases.strategies import landmarks_at
from verify.execution.runner import Runner
from verify.properties.catalog import PROPERTIES, applicable
from verify.running.config import CampaignConfig
from verify.running.engine import check_case
from verify.running.pairwise import TOO_SLOW, plan_slice
from verify.running.reduce import reduce_failure

BASE = CaseSpec(tokens=8, hidden_size=160, vocab=13)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("shards", ["even", "uneven"])
def test_each_extent_is_realized_at_every_tp_degree_with_its_shards(tp: int, shards: str) -> None:
    """A rank's vocabulary (wide: 65537 ids, long: 65 > 4 H) is the same at every TP degree, and
    an uneven row's rank 0 keeps its extra id."""
    if tp == 1 and shards == "uneven":
        return
    for extent in EXTENTS:
        spec = coverage.apply(BASE.with_(tp=tp), {"extent": extent, "shards": shards})
        assert spec.extent == extent
        assert coverage.values(spec)["shards"] == shards
        local = min(stop - start for start, stop in spec.shard_bounds())
        assert local >= {"wide": 65537, "long": 65}.get(extent, 1)
    assert {s.extent for s in landmarks_at(tp, "torch")} == set(EXTENTS)


def test_only_the_properties_holding_one_run_to_r_judge_a_large_case() -> None:
    """Relations between runs (permuted vocabularies, linearity's three upstreams, compiled
    graphs) stay on small cases, where each rerun costs little."""
    wide = coverage.apply(BASE, {"extent": "wide"})
    judging = {name for name, prop in PROPERTIES.items() if prop.covers(wide)}
    assert judging == {"differential", "contract"}


def test_the_triton_interpreter_leaves_the_extents_out_and_says_why() -> None:
    adapter = resolve("lce")
    names = tuple(n for n in applicable(adapter, (1,))[0] if n != "status")
    cpu = CampaignConfig(device="cpu")
    interpreted = plan_slice(adapter, "triton", 1, names, extents=cpu.extents_at("triton"))
    assert {s.extent for s in interpreted.rows} == {"small"}
    for extent in EXTENTS[1:]:
        assert interpreted.unsupported[("extent", extent)] == TOO_SLOW
    torch_rows = plan_slice(adapter, "torch", 1, names, extents=cpu.extents_at("torch")).rows
    assert {s.extent for s in torch_rows} == set(EXTENTS)
    assert CampaignConfig(device="cuda").extents_at("triton") == EXTENTS


def test_a_bug_past_a_vocab_tile_fails_the_wide_landmark_and_reduces_to_the_tile_edge() -> None:
    adapter = resolve("tests.helpers.tiled_impl:padded_vocab_chunks")
    runner = Runner(adapter=adapter)
    (wide,) = [coerce(adapter, s) for s in landmarks_at(1, "torch") if s.extent == "wide"]
    failing = [v for v in check_case(wide, properties=["differential"], runner=runner) if v.failed]
    assert failing, "the wide landmark passed a kernel wrong past 4096 ids"

    def check(spec: CaseSpec):
        return check_case(spec, properties=["differential"], runner=runner)

    simplest = coerce(adapter, CaseSpec())
    reduced, _ = reduce_failure(wide, failing, check, simplest, time.monotonic() + 120)
    assert reduced.vocab == CHUNK + 1, reduced


def test_a_tied_long_case_backward_twice_gives_the_same_bits() -> None:
    """The harness's own embedding lookup sums each id's rows in one order (indexing's
    accumulating backward gave the second backward other fp32 bits at 4097 tokens, which the
    contract's second-backward clause blamed on the implementation)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(65, 16, generator=gen, requires_grad=True)
    base = torch.randn(4097, 16, generator=gen)
    ids = torch.randint(0, 65, (4097,), generator=gen)
    upstream = torch.randn(4097, 16, generator=gen)
    hidden = tied_hidden(base, weight, ids)
    first = torch.autograd.grad(hidden, weight, upstream, retain_graph=True)[0]
    second = torch.autograd.grad(hidden, weight, upstream)[0]
    assert torch.equal(first, second)
