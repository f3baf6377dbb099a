"""The `verify` command line: help, clear usage errors, exit codes, and a small end-to-end run."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from verify.cases.spec import CaseSpec
from verify.cli import EXIT_FAIL, EXIT_PASS, EXIT_USAGE, campaign_exit_code, main
from verify.results import artifacts
from verify.running.engine import check_case

MUTANT = "mean_over_all_rows"  # reduction='mean' divides by every row, ignored ones too
# A case that catches it: half the rows ignored, mean reduction (loss off by a factor of 2).
CAUGHT = CaseSpec(tokens=4, hidden_size=8, vocab=16, ignore="chunk", reduction="mean", seed=3)


@pytest.mark.parametrize("command", [[], ["run"], ["replay"], ["corpus"], ["mutants"]])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: lce-verify" in capsys.readouterr().out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == EXIT_USAGE
    assert "run" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--backends", "cuda_magic"], "--backends: unknown backend 'cuda_magic'"),
        (["run", "--profile", "weekly"], "unknown profile 'weekly'"),
        (["run", "--tp", "3"], "--tp: TP degree must be one of"),
        (["run", "--budget-s", "0"], "--budget-s must be > 0"),
        (["run", "--properties", "nope"], "--properties: unknown 'nope'"),
        (["run", "--dtypes", "fp8"], "--dtypes: unknown 'fp8'; choose from fp32, bf16"),
        (["replay", "missing.json"], "missing.json: no such file"),
        (["replay", "--times", "0", "x.json"], "--times must be >= 1"),
        (["mutants", "--only", "nope"], "--only: unknown mutant(s) ['nope']"),
    ],
)
def test_bad_input_is_a_clear_usage_error(argv, message, capsys):
    assert main(argv) == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_bad_list_syntax_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--tp", "one,two"])
    assert exit_info.value.code == EXIT_USAGE
    assert "expected integers like 1,2,4" in capsys.readouterr().err


def test_an_unknown_mutant_is_a_usage_error_not_a_finding(tmp_path, capsys):
    argv = ["run", "--mutant", "no_such", "--out", str(tmp_path / "out"), "--budget-s", "5"]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--mutant: unknown 'no_such'; known: " in err and MUTANT in err
    assert not (tmp_path / "out").exists()  # no report, no failure artifacts


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (
            "schema: 1\ndtypes:\n  fp32: {}\n",
            "dtypes.fp32.logprobs is missing; add ('alpha', 'floor', 'atol', 'rtol', 'zeps')",
        ),
        ("schema: 2\n", "schema must be 1, got 2"),
        ("dtypes: [\n", "not valid YAML at line 2"),
    ],
)
def test_a_bad_tolerance_file_is_one_line_naming_the_key(text, key, tmp_path, capsys):
    bad = tmp_path / "tolerances.yaml"
    bad.write_text(text)
    assert main(["corpus", "--tolerances", str(bad)]) == EXIT_USAGE
    assert capsys.readouterr().err == f"lce-verify corpus: error: {bad}: {key}\n"


def test_corpus_needs_a_directory_with_artifacts(tmp_path, capsys):
    assert main(["corpus", "--dir", str(tmp_path)]) == EXIT_USAGE
    assert "holds no *.json artifacts" in capsys.readouterr().err


@pytest.fixture
def planted(tmp_path):
    """An artifact of the mutant's failure on `CAUGHT`, as a campaign would save it."""
    from verify.execution.mutants import applied

    with applied(MUTANT):
        verdicts = check_case(CAUGHT, properties=["differential"])
    failing = [v for v in verdicts if v.failed]
    assert failing, "the planted bug should fail the differential property on CAUGHT"
    record = artifacts.make_record(CAUGHT, "differential", failing, shrunk=False, mutant=MUTANT)
    return artifacts.write(record, tmp_path)


def test_replay_exit_codes_follow_the_verdict(planted, capsys):
    assert main(["replay", str(planted)]) == EXIT_FAIL
    out = capsys.readouterr().out
    assert (
        "FAILED" in out and "bit-identical: yes" in out and "same failure as recorded: yes" in out
    )
    assert main(["replay", "--without-mutant", str(planted)]) == EXIT_PASS
    assert "passed" in capsys.readouterr().out


def test_replay_refuses_a_tp_the_spec_cannot_split(planted, capsys):
    assert main(["replay", "--tp", "2", "--without-mutant", str(planted)]) == EXIT_PASS
    assert "(matches the artifact)" in capsys.readouterr().out
    small = artifacts.write(
        {**json.loads(planted.read_text()), "spec": json.loads(CAUGHT.with_(vocab=2).to_json())},
        planted.parent,
    )
    assert main(["replay", "--tp", "4", str(small)]) == EXIT_USAGE
    assert "vocab (2) must be >= tp (4)" in capsys.readouterr().err


def test_corpus_checks_the_fix_holds_and_the_bug_is_caught(planted, capsys):
    assert main(["corpus", "--dir", str(planted.parent)]) == EXIT_PASS
    assert "UNEXPECTED" not in capsys.readouterr().out
    # An entry whose spec cannot catch its bug (TP=1 has no grad_hidden reduction to forget).
    record = {**json.loads(planted.read_text()), "mutant": "grad_hidden_not_reduced"}
    artifacts.write(record, planted.parent)
    assert main(["corpus", "--dir", str(planted.parent)]) == EXIT_FAIL
    assert "UNEXPECTED: bug not caught" in capsys.readouterr().out


def test_run_writes_a_readable_report(tmp_path, capsys):
    out = tmp_path / "report"
    argv = shlex.split("run --backends torch --tp 1 --max-examples 4 --dtypes fp32,bf16")
    argv += ["--properties", "differential,contract", "--out", str(out)]
    assert main(argv) == EXIT_PASS
    assert "ci campaign of lce: PASSED" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["schema"] == "lce-campaign-report" and report["passed"]
    assert report["examples"] >= 4 and report["slices"][0]["status"] == "done"
    assert {c["property"] for c in report["counts"]} == {"differential", "contract"}
    assert report["dtypes"] == ["fp32", "bf16"]
    assert sum(row["examples"] for row in report["examples_by_dtype"]) == report["examples"]
    # the landmarks' one plain case of each extent ran, and the report says so
    by_extent = {row["extent"]: row["examples"] for row in report["examples_by_extent"]}
    assert sum(by_extent.values()) == report["examples"]
    assert by_extent["long"] == by_extent["wide"] == by_extent["deep"] == 1
    assert {c["dtype"] for c in report["counts"]} <= {"fp32", "bf16"}
    assert {w["output"] for w in report["worst"]} >= {"logprobs", "grad_hidden", "grad_weight"}
    markdown = (out / "report.md").read_text()
    assert "# ci campaign of lce: PASSED" in markdown and "| differential |" in markdown
    assert "| wide | 1 |" in markdown
    assert (out / "ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mutants_prints_the_kill_table(tmp_path, capsys):
    argv = ["mutants", "--only", MUTANT, "--tp", "1", "--save-corpus", str(tmp_path)]
    assert main(argv) == EXIT_PASS
    out = capsys.readouterr().out
    assert MUTANT in out and "killed 1/1" in out and "shrunk spec {" in out
    (saved,) = tmp_path.glob("*.json")
    assert artifacts.load(saved).record["mutant"] == MUTANT


def test_run_stops_at_its_budget(tmp_path, capsys):
    out = tmp_path / "report"
    argv = shlex.split("run --backends torch,triton --tp 1 --budget-s 1.5 --max-examples 500")
    argv += ["--properties", "differential", "--out", str(out)]
    code = main(argv)  # how many examples fit decides whether an open lce finding is reached
    report = json.loads((out / "report.json").read_text())
    assert code == (EXIT_PASS if report["passed"] else EXIT_FAIL)
    assert report["budget_exhausted"] and report["wall_s"] < 30
    statuses = [s["status"] for s in report["slices"]]
    assert statuses[0] == "budget" and statuses[1] in ("budget", "skipped (budget)")
    assert "(exhausted)" in (out / "report.md").read_text()


def test_a_random_profile_records_the_seed_it_drew(tmp_path, monkeypatch, capsys):
    """A nightly search stopped by its budget: the report carries the seed (so the search can be
    repeated) and Hypothesis prints no 'reproduce with @seed' line of its own."""
    monkeypatch.chdir(tmp_path)  # the nightly profile keeps its example database in the cwd
    out = tmp_path / "report"
    argv = shlex.split("run --profile nightly --backends torch --tp 1 --budget-s 1.5")
    argv += ["--properties", "differential", "--out", str(out)]
    main(argv)
    report = json.loads((out / "report.json").read_text())
    assert report["budget_exhausted"] and isinstance(report["seed"], int)
    assert f"seed {report['seed']}" in (out / "report.md").read_text()
    assert "@seed(" not in capsys.readouterr().err


def test_a_rank_dying_on_every_case_is_a_crash_finding(tmp_path, monkeypatch):
    """A job that takes its process down on every case (as a kernel that segfaults would): the
    rerun on fresh workers dies too, so it is the implementation's crash, saved once, never an
    infrastructure error."""
    from verify.execution import execute
    from verify.running.campaign import run_campaign
    from verify.running.config import CampaignConfig
    from verify.running.progress import Progress

    monkeypatch.setattr(execute, "CASE_JOB", "tests.helpers.campaign_jobs:die")
    config = CampaignConfig(
        impl="lce-torch", tp_sizes=(1,), budget_s=30, out_dir=tmp_path,
        properties=("differential",), max_examples=1,
    )  # fmt: skip
    result = run_campaign(config, Progress("test", 60, stream=None))
    assert campaign_exit_code(result.report) == EXIT_FAIL and result.report["errors"] == []
    (failure,) = result.report["failures"]
    assert (failure["backend"], failure["tier"]) == ("torch", "crash")
    assert "died (exit code 3)" in failure["line"] and len(result.artifacts) == 1


def test_report_without_matplotlib_keeps_its_tables(tmp_path, monkeypatch):
    import sys

    from verify.properties.verdict import PropertyVerdict
    from verify.results import report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    tally = report.Tally()
    verdict = PropertyVerdict(
        "differential", "logprobs", "ratio", True, 1e-7, 1e-6, 0.1, "", CAUGHT.to_json()
    )
    tally.add_example("fp32", "torch", 1, [verdict])
    meta = {"title": "t", "wall_s": 1.0, "budget_s": 10.0}
    document, paths = report.write(tally, meta, tmp_path)
    assert paths["png"] is None and document["plot"] is None
    assert not (tmp_path / report.PLOT_FILE).exists()
    text = (tmp_path / "report.md").read_text()
    assert "(no plot: matplotlib is not installed)" in text and "| logprobs | 0.1 |" in text


def test_the_impl_help_names_every_built_in_adapter() -> None:
    from verify.adapters.registry import names
    from verify.cli import build_parser

    (subcommands,) = [a for a in build_parser()._actions if a.dest == "command"]
    (impl,) = [a for a in subcommands.choices["run"]._actions if a.dest == "impl"]
    listed = set(re.findall(r"[\w-]+", impl.help.split(";")[0]))
    assert set(names()) <= listed, set(names()) - listed
