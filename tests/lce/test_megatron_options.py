"""lce.megatron and the logit options on real megatron-core objects (2 spawned ranks, gloo, TP=2):
the cap, scale and temperature of `FusedOutputOptions` on the fused path and on the stock fallback
alike; what megatron-core or a trainer applies that the fused path cannot see (an overridden
``compute_language_model_loss``, an output layer with its own forward) falls back after one
warning, never computing something else."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed: pip install lce[megatron]"
)

ROOT = Path(__file__).resolve().parents[2]


def test_megatron_applies_the_options_or_falls_back(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    if str(ROOT) not in sys.path:  # spawned ranks import the worker by module name
        sys.path.insert(0, str(ROOT))
    from tests.helpers import megatron_option_cases

    mp.spawn(megatron_option_cases.worker, args=(str(tmp_path),), nprocs=2, join=True)
    rows = [
        row for rank in range(2) for row in json.loads((tmp_path / f"rank{rank}.json").read_text())
    ]
    cases = {row["case"] for row in rows}
    for expected in ("fused-map grad_weight", "kept-logits computed once", "fallback-map loss",
                     "mup-readout", "loss-override", "loss-override logprobs",
                     "warnings"):  # fmt: skip
        assert expected in cases, f"case {expected} did not run"
    failed = [f"{row['case']}: {row['detail']}" for row in rows if not row["passed"]]
    assert not failed, "\n".join(failed)


def test_the_layer_checks_name_what_falls_back() -> None:
    import torch
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from lce.megatron import FusedOutputOptions
    from lce.megatron.head import unsupported_reason

    class Scaled(ColumnParallelLinear):
        def forward(self, *args, **kwargs):
            logits, bias = super().forward(*args, **kwargs)
            return logits * 2.0, bias

    config = ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False)
    layer = Scaled(4, 6, config=config, init_method=torch.nn.init.zeros_, bias=False)
    assert "Scaled.forward" in unsupported_reason(layer)
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        FusedOutputOptions(softcap=0.0)
    assert FusedOutputOptions(softcap=30.0).logit().softcap == 30.0
