"""``lce-verify run --impl`` and ``replay --impl``: a user's implementation through the CLI."""

from __future__ import annotations

import json

from verify.cli import EXIT_FAIL, EXIT_PASS, EXIT_USAGE, main

BROKEN = "tests.helpers.third_party_broken_impl:chunked_linear_cross_entropy"


def test_run_impl_catches_a_broken_kernel_and_its_artifact_replays(tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["run", "--impl", BROKEN, "--tp", "1", "--budget-s", "20", "--out", str(out)]
    argv += ["--properties", "differential"]
    assert main(argv) == EXIT_FAIL
    report = json.loads((out / "report.json").read_text())
    assert report["implementation"]["impl"] == BROKEN and report["outcome"] == "failed"
    assert (
        (out / "report.md")
        .read_text()
        .startswith("# ci campaign of chunked_linear_cross_entropy: FAILED")
    )
    saved = sorted((out / "failures").glob("*.json"))
    assert saved, f"no artifact written; report: {report}"
    # A longer search (a slow machine) may also save a case that torch's own implementation
    # fails; the broken kernel's own bug is the artifact whose spec torch passes.
    own = [path for path in saved if main(["replay", str(path), "--impl", "torch"]) == EXIT_PASS]
    assert own, f"every saved case also fails torch's implementation: {saved}"
    capsys.readouterr()
    # The artifact records the implementation: replay runs it again and fails the same way.
    assert main(["replay", str(own[0])]) == EXIT_FAIL
    assert "bit-identical" in capsys.readouterr().out


def test_unknown_impl_is_a_usage_error(tmp_path, capsys):
    argv = ["run", "--impl", "no_such_module:fn", "--tp", "1", "--out", str(tmp_path)]
    assert main(argv) == EXIT_USAGE
    assert "--impl" in capsys.readouterr().err
