"""Pairwise coverage (`verify.running.pairwise`, `verify.results.coverage_report`): a slice's
covering rows, with its landmark specs, give every property every supported pair of case-feature
values it counts; values the implementation does not claim are reported as not claimed, never as
pairs to reach; the report names each pair not reached with its reason."""

from __future__ import annotations

import pytest

from verify.adapters.registry import resolve
from verify.cases import coverage
from verify.cases.spec import CaseSpec, SpecError
from verify.cases.strategies import landmark_specs
from verify.properties.catalog import PROPERTIES, get
from verify.properties.rounding_model import expected_dof
from verify.results.coverage_report import CoverageTally, to_json, universe
from verify.running.pairwise import NOT_CLAIMED, judged, plan_slice

VALID = tuple(name for name in PROPERTIES if not get(name).faults)


def _reached(plan, marks) -> dict[str, set]:
    record = plan.record()
    universes = {name: universe(record, name) for name in VALID}
    got: dict[str, set] = {name: set() for name in VALID}
    for spec in (*marks, *plan.rows):
        for name, pairs in judged(spec, VALID, universes).items():
            got[name] |= pairs
    return {name: universes[name] - got[name] for name in VALID}


@pytest.mark.parametrize(("impl", "tp"), [("lce-torch", 1), ("lce-torch", 2), ("torch", 1)])
def test_rows_and_landmarks_reach_every_supported_pair(impl: str, tp: int) -> None:
    adapter = resolve(impl)
    marks = tuple(s for s in landmark_specs((tp,), ("torch",)) if s.tp == tp)
    plan = plan_slice(adapter, "torch", tp, VALID, marks)
    missing = {name: pairs for name, pairs in _reached(plan, marks).items() if pairs}
    assert not missing, {
        n: [coverage.pair_text(p) for p in sorted(m)][:5] for n, m in missing.items()
    }
    assert sum(len(universe(plan.record(), n)) for n in VALID) > 1000  # something was counted
    # the pair of the in-place scaling of saved gradients is among them (issue 34)
    if impl.startswith("lce"):
        wanted = coverage.pair(("loss_path", "fast"), ("grads", "twice"))
        assert wanted in universe(plan.record(), "differential")


@pytest.mark.parametrize(
    ("name", "unjudged"),
    [
        ("megatron_peer", {"softcap=capped", "z_loss=>0"}),
        ("graph_replay", {"loss_path=fast", "grads=hidden"}),
    ],
)
def test_a_property_judging_only_plain_cases_has_pairs_to_reach(name: str, unjudged: set) -> None:
    """megatron_peer judges only cases with no model option, graph_replay only both gradients
    on the default path: no row of the broad pool met either conjunction at TP = 1, and the
    report said "0 / 0 (100%)" for a property that had run (found on an H100 campaign)."""
    pytest.importorskip("megatron.core")
    plan = plan_slice(resolve("lce-torch"), "torch", 1, (name,))
    scope = plan.record()["properties"][name]
    assert "tp=1" not in scope["outside"]
    assert unjudged <= set(scope["outside"])  # values of cases it does not judge
    assert len(universe(plan.record(), name)) > 100


def test_values_the_implementation_does_not_claim_are_reported_not_claimed() -> None:
    """torch's F.linear_cross_entropy claims bias and label smoothing, no other model option."""
    plan = plan_slice(resolve("torch"), "torch", 1, VALID)
    record = plan.record()
    reasons = {item["value"]: item["reason"] for item in record["not_claimed"]}
    for value in ("softcap=capped", "z_loss=>0", "logit_scale=!=1", "temperature=!=1"):
        assert reasons.get(value) == NOT_CLAIMED, reasons
    assert record["features"]["softcap"] == ["none"]  # one value: it pairs with nothing
    assert record["features"]["bias"] == ["none", "biased"]  # claimed: paired
    counted = {p for name in VALID for p in universe(record, name)}
    assert not any(("softcap", "capped") in p for p in counted)


def test_report_names_each_pair_not_reached_with_its_reason() -> None:
    plan = plan_slice(resolve("torch"), "torch", 1, ("differential",))
    tally = CoverageTally()
    tally.add_plan("torch", 1, plan.record())
    first = plan.rows[0]
    tally.add_verdicts("torch", 1, [{"property": "differential", "spec": None, "tier": "ratio"}],
                       first)  # fmt: skip
    for status, reason in (("budget", "not reached in budget"), ("done", "not reached")):
        (entry,) = to_json(tally, [{"backend": "torch", "tp": 1, "status": status}])
        (prop,) = entry["properties"]
        assert 0 < prop["reached"] < prop["supported"]
        assert len(prop["not_reached"]) == prop["supported"] - prop["reached"]
        assert all(m["reason"].startswith(reason) for m in prop["not_reached"])


def test_rows_the_statistical_tier_judges_come_first_within_each_size() -> None:
    """Simplest sizes first (T = 0, T = 1, then several tokens); within each, the rows on which
    the statistical tier judges most degrees of freedom first (one extra rounding of a gradient
    shows nowhere else), so the first row of each non-empty size is one it judges."""
    plan = plan_slice(resolve("lce-torch"), "torch", 1, VALID)
    keys = [(min(spec.tokens, 2), -expected_dof(spec)) for spec in plan.rows]
    assert keys == sorted(keys)
    for size in (1, 2):
        first = next(spec for spec in plan.rows if min(spec.tokens, 2) == size)
        assert expected_dof(first) > 0, first


def test_a_case_without_valid_tokens_reaches_only_the_pairs_of_what_emptied_it() -> None:
    """Every gradient of an all-ignored or empty case is zero whatever its loss path: fast x
    twice counted there was never tried (a Triton plan's only such row ignored its one token,
    and the in-place scaling of saved gradients lived through it)."""
    live = CaseSpec(tokens=8, loss_path="fast", grads="twice", ignore="first")
    assert coverage.reached_pairs(live) == coverage.pairs_of(coverage.values(live))
    for dead, emptying in (
        (live.with_(ignore="all"), {("ignore", "all")}),
        (live.with_(tokens=0), {("tokens", "0")}),
        (live.with_(tokens=1), {("ignore", "first"), ("tokens", "1")}),
    ):
        pairs = coverage.reached_pairs(dead)
        assert pairs and all(a in emptying or b in emptying for a, b in pairs), dead
        assert coverage.pair(("loss_path", "fast"), ("grads", "twice")) not in pairs


def test_fast_counts_only_where_it_is_the_path_taken() -> None:
    """lce's fast flag is the default path for reduction="none" and without gradients: such a
    case counts as the default path, and a row cannot ask for it."""
    spec = CaseSpec(tokens=4, loss_path="fast", reduction="none")
    assert coverage.values(spec)["loss_path"] == "default"
    assert coverage.values(spec.with_(reduction="sum", grads="none"))["loss_path"] == "default"
    assert coverage.values(spec.with_(reduction="sum"))["loss_path"] == "fast"
    for row in ({"reduction": "none", "loss_path": "fast"}, {"loss_path": "fast", "grads": "none"}):
        with pytest.raises(SpecError, match="loss_path=fast takes no effect here"):
            coverage.apply(spec.with_(loss_path="default", reduction="sum"), row)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_plan_puts_fast_twice_on_a_case_with_valid_tokens(backend: str) -> None:
    plan = plan_slice(resolve("lce"), backend, 1, VALID)
    wanted = coverage.pair(("loss_path", "fast"), ("grads", "twice"))
    assert any(wanted in coverage.reached_pairs(spec) for spec in plan.rows)
