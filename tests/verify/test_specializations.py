"""`verify.running.specializations`: the compile keys of lce's Triton kernels, recorded on the CPU
without running them, and which arguments the kernels specialize on (docs/NIGHTLY.md).

The keys need the compiled kernels (Triton's `JITFunction`), so the recording runs in a process
without ``TRITON_INTERPRET`` (the suite sets it for everything else)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys
from verify.cases.spec import CaseSpec
from verify.running.specializations import launch, recording
base = CaseSpec(tokens=16, hidden_size=64, vocab=40, backend="triton", upstream="random")
changes = json.loads(sys.argv[1])
new = []
with recording() as seen:
    for change in changes:
        before = set(seen)
        launch(base.with_(**change))
        new.append(sorted({name for name, _ in seen - before}))
print(json.dumps(new))
"""


def _new_kernels(*changes: dict) -> list[list[str]]:
    """Per spec (``base`` with each change, in order): the kernels it compiles that none before
    it compiled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(changes)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_token_count_vocab_and_hidden_size_classes_reuse_the_compiles():
    first, one_token, odd_tokens, one_row, odd_hidden, vocab_16 = _new_kernels(
        {},
        {"tokens": 1},  # T 16 -> 1: == 1 was a class (a constexpr) of its own
        {"tokens": 37},  # divisible by 16 -> other; the per-token rows lose their alignment
        {"vocab": 1},  # V 40 -> 1 (== 1), and the d_logits chunk with it
        {"hidden_size": 72},  # H 64 -> 72 (divisible by 16 -> other), TMA loads
        {"vocab": 48},  # V 40 -> 48 (other -> divisible by 16)
    )
    assert first == ["d_logits", "forward", "merge", "place_target", "target"]  # none compiled yet
    # T only bounds the loops and masks the per-token epilogue of forward and d_logits; the merge
    # kernel keeps it (its loads' alignment).
    assert one_token == ["merge"]
    assert odd_tokens == ["merge"]
    # V and d_logits' chunk width are specialized on their divisibility by 16 alone.
    assert one_row == []
    # Under TMA, H only counts the K tiles: rounded up to the tile, 64 and 72 share a class.
    assert odd_hidden == []
    assert vocab_16 == ["d_logits", "forward"]


def test_pointer_loads_keep_hidden_size_and_layout_specialized():
    transposed, odd_hidden = _new_kernels(
        {"layout": "transposed"}, {"layout": "transposed", "hidden_size": 72}
    )
    assert transposed == ["d_logits", "forward", "merge", "place_target", "target"]
    # The pointer loads' K loop masks its tail by H: its class stays in the key.
    assert odd_hidden == ["d_logits", "forward"]
