"""lce.megatron against megatron-core's stock LM head, on real megatron-core objects (CPU, gloo).

One spawned world of 2 ranks runs every case of ``ci/gpu_megatron_check.py`` (the same script the
GPU check runs with NCCL and Triton) at TP=1 (DP=2) and TP=2, sequence parallel off and on:
ColumnParallelLinear + vocab_parallel_cross_entropy as B, float64 materialized R, tolerances.yaml
(ratio tier against the stock path, envelope tier against R). TP=1 runs inside the 2-rank world as
DP=2 x TP=1, so a separate 1-process world would repeat the same cases.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed: pip install lce[megatron]"
)

ROOT = Path(__file__).resolve().parents[2]


def _check_script():
    if str(ROOT) not in sys.path:  # spawned ranks import the script's worker by module name
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("ci.gpu_megatron_check")


# Case families every run must contain at each TP degree (a case that silently did not run fails).
EXPECTED = {
    1: ("loss/fp32/sp=0", "loss/bf16/sp=0", "loss/fp32_bf16/sp=0", "logprobs/fp32/sp=0",
        "logprobs/bf16/sp=0", "logprobs/fp32_bf16/sp=0", "stock-fallback/fp32", "tied-gpt/fp32",
        "frozen-head/fp32/sp=0", "fallback-bias", "main-grad/fp32/sp=0/assumed",
        "main-grad/bf16/sp=0/random", "main-grad/fp32_bf16/sp=0/assumed"),
    2: ("loss/fp32/sp=1", "loss/bf16/sp=1", "loss/fp32_bf16/sp=1", "logprobs/fp32/sp=1",
        "logprobs/bf16/sp=1", "logprobs/fp32_bf16/sp=1", "tied-gpt/fp32", "tied-gpt-logprobs/fp32",
        "frozen-head/fp32/sp=1", "fallback-warning", "main-grad/fp32/sp=1/random",
        "main-grad/bf16/sp=0/assumed", "main-grad/fp32_bf16/sp=1/random"),
}  # fmt: skip


def test_fused_megatron_head_equals_stock(tmp_path: Path) -> None:
    rows = _check_script().run(2, "torch", tmp_path)
    ran = {(row["tp"], row["case"]) for row in rows}
    missing = [
        (tp, case) for tp, cases in EXPECTED.items() for case in cases if (tp, case) not in ran
    ]
    assert not missing, f"cases that did not run: {missing}"
    failed = [
        f"tp={row['tp']} {row['case']} {row['output']}: {row['detail']}"
        for row in rows
        if not row["passed"]
    ]
    assert not failed, "\n".join(failed)


def test_patch_and_inputs_reject_misuse() -> None:
    import torch

    from lce.megatron import output_layer_loss, patch_gpt_model

    with pytest.raises(ValueError, match="not a megatron-core GPTModel"):
        patch_gpt_model(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="returns must be one of"):
        patch_gpt_model(torch.nn.Linear(2, 2), returns="logits")
    layer = torch.nn.Linear(4, 6)
    with pytest.raises(ValueError, match=r"hidden must be \[S, B, H\] and labels \[B, S\]"):
        output_layer_loss(torch.zeros(3, 4), layer, torch.zeros(3, dtype=torch.long))


def _column_layer(**kwargs):
    import torch
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    config = ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False)
    return ColumnParallelLinear(4, 6, config=config, init_method=torch.nn.init.zeros_, **kwargs)


@pytest.mark.parametrize(
    ("layer_kwargs", "reason"),
    [
        ({"bias": False}, None),
        ({"bias": True}, "bias"),
        ({"bias": True, "skip_bias_add": True}, None),  # the bias is returned, not added: fusable
        ({"bias": False, "disable_grad_reduce": True}, "disable_grad_reduce"),
    ],
)
def test_which_output_layers_fall_back(layer_kwargs: dict, reason: str | None) -> None:
    from lce.megatron.head import unsupported_reason

    found = unsupported_reason(_column_layer(**layer_kwargs))
    assert found is None if reason is None else reason in found


def test_a_layer_that_is_not_column_parallel_is_refused() -> None:
    import torch

    from lce.megatron import output_layer_loss

    hidden, labels = torch.zeros(3, 2, 4), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="must be megatron-core's ColumnParallelLinear"):
        output_layer_loss(hidden, torch.nn.Linear(4, 6), labels)
