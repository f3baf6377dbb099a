"""Sizes past real kernels' tile and chunk boundaries (`verify.cases.spec.EXTENTS`): one dimension
at a time in every slice's landmarks, left out (and said so) where Triton runs in its
interpreter, judged against R by the properties that hold one run to it, a failure there halved
down to the first size past the boundary, and the case memos bounded by the cases' sizes."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from tests.helpers.tiled_impl import CHUNK
from verify.adapters.features import coerce
from verify.adapters.registry import resolve
from verify.cases.build import tied_hidden
from verify.cases.memo import MAX_ELEMENTS, elements, sized_memo
from verify.cases.spec import EXTENTS, CaseSpec, extent_sizes
from verify.cases.strategies import landmarks_at
from verify.execution.runner import Runner
from verify.properties.catalog import PROPERTIES
from verify.running.campaign import plan
from verify.running.config import CampaignConfig
from verify.running.engine import check_case
from verify.running.reduce import reduce_failure

BASE = CaseSpec(tokens=8, hidden_size=160, vocab=13)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_slice_starts_with_one_plain_case_of_each_extent(tp: int) -> None:
    """A rank's vocabulary (wide: 65537 ids, long: 65 > 4 H) is the same at every TP degree, and
    an uneven vocabulary's rank 0 keeps its extra id."""
    marks = {s.extent: s for s in landmarks_at(tp, "torch")}
    assert set(marks) == set(EXTENTS)
    for extent, sizes in (("wide", 65537), ("long", 65)):
        local = min(stop - start for start, stop in marks[extent].shard_bounds())
        assert local >= sizes and marks[extent].hidden_size == 16
    assert marks["long"].num_tokens == 4097 and marks["deep"].hidden_size == 4097
    uneven = BASE.with_(tp=tp, vocab=4 * tp + 1)
    if tp > 1:
        wide = uneven.with_(**extent_sizes("wide", tp, uneven.vocab))
        assert not wide.even_shards and wide.extent == "wide"


def test_only_the_properties_holding_one_run_to_r_judge_a_large_case() -> None:
    """Relations between runs (permuted vocabularies, linearity's three upstreams, compiled
    graphs) stay on small cases, where each rerun costs little."""
    wide = BASE.with_(**extent_sizes("wide", 1, BASE.vocab))
    judging = {name for name, prop in PROPERTIES.items() if prop.covers(wide)}
    assert judging == {"differential", "contract"}


def test_the_triton_interpreter_leaves_the_extents_out_and_says_why(tmp_path) -> None:
    cpu = CampaignConfig(device="cpu", backends=("triton",), tp_sizes=(1,), out_dir=tmp_path)
    assert cpu.extents_at("triton") == ("small",) and cpu.extents_at("torch") == EXTENTS
    assert CampaignConfig(device="cuda").extents_at("triton") == EXTENTS
    (note,) = [u for u in plan(cpu).untested if "extents" in u.what]
    assert note.what == "lce-triton: extents long, wide, deep" and "interpreter" in note.reason
    assert not [u for u in plan(replace(cpu, backends=("torch",))).untested if "extents" in u.what]


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


def test_a_campaign_can_leave_an_extent_out() -> None:
    config = CampaignConfig(exclude=("extent=wide",))
    config.validate()
    (wide,) = [s for s in landmarks_at(1, "torch") if s.extent == "wide"]
    assert config.excluded(wide) and not config.excluded(BASE)
    with pytest.raises(ValueError, match="extents: small, long, wide, deep"):
        CampaignConfig(exclude=("extent=huge",)).validate()


def test_the_case_memos_hold_many_small_cases_but_few_large_ones() -> None:
    """64 cached oracles of large cases outgrew a 24 GiB machine: the memos are bounded by the
    cases' elements too (the last case always kept)."""
    calls = []

    @sized_memo(max_items=64)
    def memo(spec: CaseSpec) -> int:
        calls.append(spec)
        return len(calls)

    smalls = [BASE.with_(seed=s) for s in range(40)]
    for spec in smalls:
        memo(spec)
    wides = [s.with_(seed=k) for k, s in enumerate(landmarks_at(4, "torch")) if s.extent == "wide"]
    wides += [wides[0].with_(seed=99)]
    for spec in wides:
        memo(spec)
    assert elements(wides[0]) > MAX_ELEMENTS // 2
    memo(smalls[-1])
    memo(wides[-1])
    assert len(calls) == 40 + len(wides)  # the newest small and wide cases were still held
    memo(wides[0])
    assert len(calls) == 41 + len(wides)  # an older wide one was not
