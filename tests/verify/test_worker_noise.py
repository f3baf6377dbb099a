"""Workers that import megatron-core print none of its "Transformer Engine and Apex are not
installed" warnings (four per worker, again on every pool rebuild)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed: pip install lce[megatron]"
)

SCRIPT = """
from verify.cases.spec import CaseSpec
from verify.distributed import WorkerPool
from verify.properties.peers import MEGATRON_JOB

spec = CaseSpec(tokens=3, hidden_size=4, vocab=8, tp=2)
with WorkerPool(world_size=2) as pool:
    pool.run(MEGATRON_JOB, {"spec": spec.to_json()}, tp=2)
"""


def test_megatron_import_warnings_filtered_in_workers() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert "Transformer Engine and Apex are not installed" not in done.stderr
