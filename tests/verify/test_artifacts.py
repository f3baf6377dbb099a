"""Failure artifacts: complete records, atomic unique writes, clear errors on bad files."""

from __future__ import annotations

import json
import math
import re

import pytest

from verify.cases.spec import CaseSpec
from verify.properties.verdict import PropertyVerdict
from verify.results import artifacts

SPEC = CaseSpec(
    tokens=5,
    hidden_size=6,
    vocab=17,
    tp=2,
    hidden_dtype="bf16",
    weight_dtype="bf16",
    backend="torch",
    seed=123,
)


def _verdict(output: str, ratio: float, passed: bool = False) -> PropertyVerdict:
    return PropertyVerdict(
        "differential",
        output,
        "ratio",
        passed,
        ratio * 2e-3,
        2e-3,
        ratio,
        "ratio: ...",
        SPEC.to_json(),
    )


def _record(ratio: float = 3.5, **kw) -> dict:
    return artifacts.make_record(
        SPEC, "differential", [_verdict("grad_weight", ratio)], shrunk=True, **kw
    )


def test_record_holds_everything_a_replay_needs(tmp_path):
    path = artifacts.write(_record(mutant="grad_weight_bf16_accumulation", examples=7), tmp_path)
    loaded = artifacts.load(path)
    rec = loaded.record
    assert loaded.spec == SPEC
    assert (rec["schema"], rec["schema_version"]) == (artifacts.SCHEMA, artifacts.SCHEMA_VERSION)
    assert (rec["backend"], rec["tp"], rec["dtype"], rec["shrunk"]) == ("torch", 2, "bf16", True)
    assert rec["mutant"] == "grad_weight_bf16_accumulation" and rec["examples"] == 7
    assert set(rec["versions"]) >= {"python", "torch", "triton", "hypothesis", "megatron-core"}
    assert rec["versions"]["torch"] and rec["device"].startswith("cpu")
    # the commit of this checkout (a seed replays its examples only with the same harness)
    revision = rec["versions"]["lce-source"]
    assert revision is None or re.fullmatch(r"[0-9a-f]{12}(-dirty)?", revision), revision
    tol = rec["tolerances"]
    assert tol["dtype"] == "bf16" and set(tol["entries"]) == {"grad_weight"}
    assert set(tol["entries"]["grad_weight"]) == {"alpha", "floor", "atol", "rtol", "zeps"}
    assert len(tol["sha256"]) == 64
    assert rec["replay"] == f"python -m verify replay {path}"
    (verdict,) = loaded.verdicts
    assert "spec" not in verdict  # stored once, at the top
    assert verdict["output"] == "grad_weight" and verdict["ratio"] == pytest.approx(3.5)


def test_non_finite_numbers_are_strict_json(tmp_path):
    path = artifacts.write(_record(ratio=math.inf), tmp_path)
    text = path.read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    (verdict,) = artifacts.load(path).verdicts
    assert verdict["ratio"] == "inf" and artifacts.parse_number(verdict["ratio"]) == math.inf


def test_same_failure_is_stored_once_and_never_overwritten(tmp_path):
    first = artifacts.write(_record(), tmp_path)
    before = first.read_bytes()
    again = artifacts.write(_record(), tmp_path)
    other = artifacts.write(_record(ratio=4.0), tmp_path)
    assert again == first and first.read_bytes() == before
    assert other != first and other.name.startswith("differential-lce-torch-tp2-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    def broken_dump(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(artifacts.json, "dump", broken_dump)
    with pytest.raises(OSError, match="disk full"):
        artifacts.write(_record(), tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"schema": "something-else"}', "not a failure artifact"),
        ('{"schema": "lce-failure", "schema_version": 1}', "lacks"),
    ],
)
def test_bad_files_are_refused_with_the_file_name(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(artifacts.ArtifactError, match=message) as info:
        artifacts.load(path)
    assert str(path) in str(info.value)


def test_newer_schema_and_bad_spec_are_refused(tmp_path):
    record = json.loads(artifacts.write(_record(), tmp_path).read_text())
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**record, "schema_version": artifacts.SCHEMA_VERSION + 1}))
    with pytest.raises(artifacts.ArtifactError, match="newer than this verify"):
        artifacts.load(newer)
    bad_spec = tmp_path / "spec.json"
    bad_spec.write_text(json.dumps({**record, "spec": {**record["spec"], "vocab": 0}}))
    with pytest.raises(artifacts.ArtifactError, match="invalid spec: vocab must be >= 1"):
        artifacts.load(bad_spec)
    with pytest.raises(artifacts.ArtifactError, match="no such file"):
        artifacts.load(tmp_path / "missing.json")
