"""The GPU tiles fit a Hopper SM: every kernel, every dtype, compiled for sm_90 on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
# cudaDevAttrMaxSharedMemoryPerBlockOptin on H100 and H200: 227 KiB.
HOPPER_SHARED_BYTES = 227 * 1024


@pytest.fixture(scope="module")
def compiled_sizes() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(HERE.parent / "helpers" / "triton_shared_memory.py")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0 and "ptxas" in done.stderr:
        pytest.skip(f"triton cannot compile for sm_90 here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_kernel_dtype_and_load_path_compiles(compiled_sizes):
    tiled = [r for r in compiled_sizes if r["loads"] != "rows"]
    combos = {(r["kernel"], r["dtype"], r["loads"]) for r in tiled}
    assert len(combos) == 3 * 3 * 2  # forward, d_logits and d_logits' capped tile
    # The logit options on (bias, softcap, label smoothing) and off: the two tiled kernels (TMA
    # loads), the capped tile (both load paths), the merge, the two row kernels and the two of
    # the target lane (its dot in every dtype).
    on = {(r["kernel"], r["loads"]) for r in compiled_sizes if r["options"] == "options"}
    assert len(on) == 2 + 2 + 5
    rows_off = {
        (r["kernel"], r["dtype"])
        for r in compiled_sizes
        if (r["loads"], r["options"]) == ("rows", "plain")
    }
    assert len(rows_off) == 4 + 3


def test_gpu_tiles_fit_hopper_shared_memory(compiled_sizes):
    too_big = [r for r in compiled_sizes if r["shared"] > HOPPER_SHARED_BYTES]
    assert not too_big, f"over {HOPPER_SHARED_BYTES} bytes of shared memory: {too_big}"
