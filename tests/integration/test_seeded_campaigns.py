"""The seeded-campaigns driver (ci/seeded_campaigns.py), checked without running a campaign:
seeds parsed, each campaign on its own cores with its own scratch paths, and the table built from
the reports' slices and coverage."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "seeded_campaigns", ROOT / "ci" / "seeded_campaigns.py"
)
seeded = importlib.util.module_from_spec(_spec)
sys.modules["seeded_campaigns"] = seeded
_spec.loader.exec_module(seeded)


def test_seeds_ranges_and_lists() -> None:
    assert seeded.seeds_of("1-4") == [1, 2, 3, 4]
    assert seeded.seeds_of("1,4,7-9,4") == [1, 4, 7, 8, 9]
    with pytest.raises(SystemExit, match="--seeds"):
        seeded.seeds_of("1-x")


def test_parallel_campaigns_share_no_scratch_path_and_no_core(tmp_path) -> None:
    sets = seeded.core_sets(2)
    if len(os.sched_getaffinity(0)) >= 2:
        assert sets[0] and sets[1] and not sets[0] & sets[1]
    first = seeded.environment(tmp_path / "seed-1", sets[0])
    second = seeded.environment(tmp_path / "seed-2", sets[1])
    scratch = ("TMPDIR", "TRITON_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
               "HYPOTHESIS_STORAGE_DIRECTORY")  # fmt: skip
    for name in scratch:
        assert first[name] != second[name] and Path(first[name]).is_dir()
    argv = seeded.command(3, tmp_path / "seed-3" / "report", ["--budget-s", "60"])
    assert argv[argv.index("--seed") + 1] == "3" and argv[-2:] == ["--budget-s", "60"]
    assert argv[argv.index("--profile") + 1] == "ci"


def test_table_counts_pairs_per_slice(tmp_path) -> None:
    report = {
        "examples": 12, "failures": [{"id": "x"}],
        "slices": [
            {"backend": "lce-torch", "tp": 1, "status": "budget", "examples": 9},
            {"backend": "lce-triton", "tp": 1, "status": "skipped (budget)", "examples": 0},
        ],
        "coverage": [{"backend": "lce-torch", "tp": 1, "properties": [
            {"reached": 30, "supported": 40}, {"reached": 10, "supported": 10}]}],
    }  # fmt: skip
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    row = seeded.summary_row(5, 1, path, 301.4)
    assert row["verdict"] == "failed" and row["failures"] == 1
    assert row["slices"][0] | {} == {
        "slice": "lce-torch TP=1", "status": "budget", "examples": 9,
        "pairs_reached": 40, "pairs_supported": 50,
    }  # fmt: skip
    missing = seeded.summary_row(6, 3, tmp_path / "none.json", 2.0)
    table = seeded.markdown([row, missing])
    assert "| 5 | failed | 12 | 1 | 9 ex, 80% pairs | 0 ex (skipped (budget)) | 301 |" in table
    assert "| 6 | infrastructure | None | None | - | - | 2 |" in table
    assert table.endswith("0/2 passed")
