"""The numbers of tolerances.yaml that follow from a dtype's unit roundoff u (torch.finfo): zeps is
2u of the dtype the logits are formed in, and a gradient returned in 16 bits has a floor of at least
its own u (its largest element's final rounding). A slip here (u taken as 2^-9 for bf16, 2^-12 for
fp16) held every 16-bit check to half its derived logit term until 2026-11-24."""

from __future__ import annotations

import pytest
import torch

from verify.numerics.tolerances import OUTPUTS, load

# dtype key -> (dtype the logits are formed in, dtype each gradient comes back in)
DTYPES = {
    "fp32": (torch.float32, {"grad_hidden": torch.float32, "grad_weight": torch.float32}),
    "bf16": (torch.bfloat16, {"grad_hidden": torch.bfloat16, "grad_weight": torch.bfloat16}),
    "fp16": (torch.float16, {"grad_hidden": torch.float16, "grad_weight": torch.float16}),
    "fp32_bf16": (torch.bfloat16, {"grad_hidden": torch.float32, "grad_weight": torch.bfloat16}),
    "fp64": (torch.float64, {"grad_hidden": torch.float64, "grad_weight": torch.float64}),
}


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


@pytest.mark.parametrize("key", sorted(DTYPES))
def test_zeps_is_twice_the_logits_unit_roundoff(key: str) -> None:
    logits, _ = DTYPES[key]
    for output in OUTPUTS:
        zeps = load().get(key, output).zeps
        # the file writes two significant digits
        assert zeps == pytest.approx(2 * unit_roundoff(logits), rel=0.03), (key, output, zeps)


@pytest.mark.parametrize("key", ["bf16", "fp16", "fp32_bf16"])
def test_16_bit_gradients_floor_covers_their_final_rounding(key: str) -> None:
    _, returned = DTYPES[key]
    for output, dtype in returned.items():
        if dtype.itemsize == 2:
            floor = load().get(key, output).floor
            assert floor >= 0.99 * unit_roundoff(dtype), (key, output, floor)
