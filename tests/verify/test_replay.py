"""Reproduction from saved seeds: a planted bug found by a campaign is saved shrunk, replays the
same failure bit for bit, passes once the bug is gone, and shows the same reference at TP=1 and 4.
The regression corpus (verify/corpus) runs here too: every entry passes, every planted bug is
caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from verify.cli import CORPUS_DIR, EXIT_FAIL, EXIT_PASS, EXIT_USAGE, main
from verify.distributed import WorkerPool
from verify.execution.mutants import MUTANTS
from verify.results import artifacts
from verify.running.campaign import CampaignConfig, run_campaign
from verify.running.progress import Progress
from verify.running.replay import replay, summary_lines

# A mutant whose planting changed may need a new case: the self-test finds and saves them.
REGENERATE = "regenerate with `python -m verify mutants --save-corpus verify/corpus`"
MUTANT = "grad_output_row0"  # only grad_output[0] applied to every row: differential catches it


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(world_size=4, timeout_s=120) as workers:
        yield workers


@pytest.fixture(scope="module")
def found(tmp_path_factory, pool):
    """A small campaign with the bug planted: torch at TP=4 (so the shrunk spec has a vocab that
    also splits 4 ways), the differential property."""
    out = tmp_path_factory.mktemp("campaign")
    config = CampaignConfig(
        impl="lce-torch",
        tp_sizes=(4,),
        budget_s=120,
        out_dir=out,
        properties=("differential",),
        mutant=MUTANT,
        max_examples=20,
    )
    return run_campaign(config, Progress("test", 120, stream=None), pool=pool)


def test_planted_bug_produces_a_shrunk_artifact(found):
    assert not found.passed
    # The first search's failure; the restarts that leave its trigger out may save more.
    path = found.artifacts[0]
    artifact = artifacts.load(path)
    rec = artifact.record
    assert rec["mutant"] == MUTANT and rec["shrunk"] is True and rec["property"] == "differential"
    assert any(artifacts.is_failure(v) for v in rec["verdicts"])
    assert len(rec["reference_sha256"]) == 64
    report = json.loads(found.paths["json"].read_text())
    failure = report["failures"][0]
    assert len(report["failures"]) == len(found.artifacts)
    assert failure["artifact"] == str(path) and failure["shrunk"] is True
    # Shrinking reached a small case: Hypothesis's minimal example, not the first one found.
    assert artifact.spec.tp == 4 and artifact.spec.num_tokens <= 4 and artifact.spec.vocab <= 8


def test_replay_fails_the_same_way_bit_for_bit(found, pool):
    artifact = artifacts.load(found.artifacts[0])
    result = replay(artifact, pool=pool, times=2)
    assert result.mutant == MUTANT and not result.passed
    assert result.identical  # both runs: same kernel outputs and verdict numbers, bit for bit
    assert result.same_failure  # the recorded outputs fail again with the recorded measurements
    assert result.reference_matches_artifact is True


def test_a_differing_reference_names_its_outputs(found, tmp_path):
    """A replay whose reference differs from the recorded one says which outputs differ."""
    record = json.loads(artifacts.load(found.artifacts[0]).path.read_text())
    assert set(record["reference_output_sha256"]) >= {"logprobs", "grad_hidden"}
    record["reference_sha256"] = "0" * 64
    record["reference_output_sha256"]["grad_hidden"] = "0" * 16
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(record))
    result = replay(artifacts.load(tampered), tp=1, mutant=None, times=1)
    assert result.reference_matches_artifact is False
    assert result.reference_outputs_differing == ["grad_hidden"]
    assert "DIFFERS from artifact on grad_hidden" in "\n".join(summary_lines(result))


def _edited(tmp_path, change) -> str:
    """A corpus entry (a planted bug at TP=1) with ``change(record)`` applied, as a file."""
    source = CORPUS_DIR / "differential-torch-tp1-fc0b3066d5cccd43.json"
    record = json.loads(source.read_text())
    change(record)
    edited = tmp_path / source.name
    edited.write_text(json.dumps(record))
    return str(edited)


@pytest.mark.parametrize("command", ["replay", "corpus"])
def test_a_replay_of_other_numbers_does_not_reproduce(command, tmp_path, capsys):
    """An edited seed gives another problem: its reference differs from the recorded one, so the
    verdicts say nothing about the recorded failure; replay and corpus say so and fail."""
    edited = _edited(tmp_path, lambda r: r["spec"].update(seed=r["spec"]["seed"] + 1))
    argv = ["replay", edited] if command == "replay" else ["corpus", "--dir", str(tmp_path)]
    assert main(argv) == EXIT_FAIL
    out = capsys.readouterr().out
    assert "DOES NOT REPRODUCE: the recomputed reference differs from the recorded one" in out
    assert out.splitlines()[-1].endswith(" not as expected")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r["spec"].pop("seed"), "spec lacks ['seed']; an artifact records every field"),
        (lambda r: r.update(mutant="no_such"), "unknown mutant 'no_such'; known: "),
        (lambda r: r.update(property="differential,nope"), "unknown property ['nope']; known: "),
    ],
)
def test_an_artifact_naming_what_does_not_exist_is_a_usage_error(change, message, tmp_path, capsys):
    edited = _edited(tmp_path, change)
    for argv in (["replay", edited], ["corpus", "--dir", str(tmp_path)]):
        assert main(argv) == EXIT_USAGE
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_corpus_mutant_entries_reproduce_their_recorded_failure(capsys):
    """Each planted-bug entry fails the recorded (property, output, tier) checks: the output says
    "same failure as recorded: yes" for every one (it said "no" for 11 of 12: the comparison
    required the measured values of a recording made before lce's numerics changed)."""
    assert main(["corpus"]) == EXIT_PASS
    lines = [line for line in capsys.readouterr().out.splitlines() if "same failure" in line]
    planted = [p for p in CORPUS_DIR.glob("*.json") if json.loads(p.read_text()).get("mutant")]
    assert len(lines) == len(planted) >= 12
    assert all(line.strip().startswith("same failure as recorded: yes") for line in lines), lines


def test_rehash_rerecords_a_stale_reference_and_nothing_else(tmp_path):
    """After a deliberate change to R, `verify rehash` rewrites the recorded hashes (and says
    when); a current file is left byte for byte as it was."""
    source = sorted(CORPUS_DIR.glob("*.json"))[0]
    record = json.loads(source.read_text())
    current = record["reference_sha256"]
    record["reference_sha256"] = "0" * 64
    record["reference_output_sha256"] = {"logprobs": "0" * 16}
    stale = tmp_path / source.name
    stale.write_text(json.dumps(record))
    assert artifacts.rehash(stale) == ("0" * 64, current)
    rewritten = json.loads(stale.read_text())
    assert rewritten["reference_sha256"] == current and "reference_rehashed" in rewritten
    assert rewritten["reference_output_sha256"] == artifacts.reference_output_sha256(
        artifacts.load(stale).spec
    )
    assert {k: v for k, v in rewritten.items() if not k.startswith("reference")} == {
        k: v for k, v in record.items() if not k.startswith("reference")
    }
    before = stale.read_bytes()
    assert artifacts.rehash(stale) == (current, current) and stale.read_bytes() == before


def test_replay_passes_once_the_bug_is_removed(found, pool):
    result = replay(artifacts.load(found.artifacts[0]), pool=pool, mutant=None, times=2)
    assert result.passed and result.identical and result.mutant is None


def test_replay_at_tp1_and_tp4_sees_the_same_reference(found, pool):
    artifact = artifacts.load(found.artifacts[0])
    at1 = replay(artifact, tp=1, times=2)
    at4 = replay(artifact, tp=4, pool=pool, times=2)
    assert at4.spec.tp == 4 and at1.spec.tp == 1
    assert at1.reference_sha256 == at4.reference_sha256 == artifact.record["reference_sha256"]
    assert not at1.passed and at1.identical  # the planted bug fails at TP=1 too, repeatably
    assert not at4.passed and at4.identical
    assert replay(artifact, tp=1, mutant=None, times=1).passed


def test_regression_corpus_passes_and_still_catches_its_bugs(pool):
    entries = sorted(CORPUS_DIR.glob("*.json"))
    assert entries, "verify/corpus holds no artifacts"
    planted = set()
    for path in entries:
        artifact = artifacts.load(path)
        use = pool if artifact.spec.tp > 1 else None
        fixed = replay(artifact, pool=use, mutant=None, times=1)
        assert fixed.passed, f"{path.name} fails on the current code: fix it (or the case)"
        mutant = artifact.record.get("mutant")
        if mutant:
            planted.add(mutant)
            caught = replay(artifact, pool=use, times=1)
            assert not caught.passed, f"{path.name} no longer catches {mutant}: {REGENERATE}"
            assert caught.same_failure, f"{path.name}: {mutant} fails otherwise: {REGENERATE}"
    assert planted <= set(MUTANTS) and len(planted) >= 10, f"corpus covers {sorted(planted)}"


def test_corpus_references_are_current_bit_for_bit():
    """Every entry's recorded reference sha256 is what R computes now (after a deliberate change to
    R: `python -m verify rehash verify/corpus/*.json`)."""
    for path in sorted(CORPUS_DIR.glob("*.json")):
        artifact = artifacts.load(path)
        assert artifacts.reference_sha256(artifact.spec) == artifact.record["reference_sha256"], (
            f"{path.name}: stale reference_sha256"
        )


def test_reference_bits_do_not_depend_on_the_cpu_vector_unit():
    """R is the same bits with ATen's scalar kernels as with its AVX2/AVX-512 ones (a BLAS GEMM or
    a vectorized reduction is not), so an artifact made on any machine replays its reference."""
    entries = sorted(CORPUS_DIR.glob("*.json"))
    script = (
        "import sys; from verify.results import artifacts\n"
        "for p in sys.argv[1:]: print(artifacts.reference_sha256(artifacts.load(p).spec))"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, entries)],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    scalar = done.stdout.split()
    here = [artifacts.reference_sha256(artifacts.load(p).spec) for p in entries]
    assert scalar == here
