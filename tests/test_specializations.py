"""`verify.running.specializations`: the compile keys of lce's Triton kernels, recorded on the CPU
without running them, change exactly where Triton would compile again.

The keys need the compiled kernels (Triton's `JITFunction`), so the recording runs in a process
without ``TRITON_INTERPRET`` (the suite sets it for everything else)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import json
from verify.cases.spec import CaseSpec
from verify.running.specializations import launch, recording
base = CaseSpec(tokens=16, hidden_size=64, vocab=40, backend="triton", upstream="random")
specs = [
    base,
    base.with_(tokens=37),  # T divisible by 16 -> other
    base.with_(tokens=41),  # T other -> other: the same class
    base.with_(tokens=41, hidden_size=72),  # H divisible by 16 -> other
]
new = []
with recording() as seen:
    for spec in specs:
        before = set(seen)
        launch(spec)
        new.append(sorted({name for name, _ in seen - before}))
print(json.dumps(new))
"""


def test_keys_change_with_an_argument_class_not_with_its_value():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    first, other_t, same_class, other_h = json.loads(out.stdout.strip().splitlines()[-1])
    assert first == ["d_logits", "forward", "merge"]  # nothing compiled yet
    # The kernels are specialized on T (Triton's default), each compiles again.
    assert other_t == ["d_logits", "forward", "merge"]
    assert same_class == []  # 37 and 41 share a class: every compile is reused
    assert other_h == ["d_logits", "forward"]  # the merge kernel does not take H
