"""Status agreement: on invalid input every backend raises, with the same error type, and the
message names the offending argument (docs/DESIGN.md: both backends refuse the same inputs)."""

from __future__ import annotations

import torch

from lce.backends import resolve_backend_name
from verify.cases.spec import BACKENDS, CaseSpec
from verify.execution.runner import Runner
from verify.properties.verdict import PropertyVerdict, flag

# The word each fault's error message must contain: the argument a user has to fix.
NAMED_ARGUMENT = {
    "target_ge_vocab": "targets",
    "target_negative": "targets",
    "temperature_zero": "temperature",
    "temperature_nan": "temperature",
    "hidden_size_mismatch": "hidden",
    "targets_float": "targets",
    "softcap_zero": "softcap",
    "smoothing_above_one": "label_smoothing",
    "bias_length": "bias",
}


def available_backends(device: str = "cpu") -> tuple[str, ...]:
    """Backends runnable here on ``device`` tensors (triton: CUDA, or TRITON_INTERPRET=1 on the
    CPU). Asked for the CPU alone, a GPU campaign dropped Triton from its plan without a word."""
    usable = []
    for backend in BACKENDS:
        try:
            resolve_backend_name(backend, torch.device(device))
        except ValueError:
            continue
        usable.append(backend)
    return tuple(usable)


def status_agreement(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """Every backend of the implementation refuses the spec's fault with one error type naming
    the argument."""
    here = available_backends(runner.device)
    backends = [b for b in runner.adapter.capabilities.backends if b in here]
    runs = {b: runner.run(spec.with_(backend=b)) for b in backends}
    verdicts = []
    for backend, run in runs.items():
        named = NAMED_ARGUMENT[spec.fault] in run.error
        ok = run.status == "raised" and named
        detail = f"{backend}: {run.status}: {run.error[:200] or 'returned values'}"
        verdicts.append(flag("status", spec.with_(backend=backend), "status", ok, detail))
    kinds = {b: run.error.split(":")[0] for b, run in runs.items()}
    same = len(set(kinds.values())) == 1 and len({r.status for r in runs.values()}) == 1
    verdicts.append(flag("status", spec, "status_agreement", same, f"per backend {kinds}"))
    return verdicts
