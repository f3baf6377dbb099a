"""How a kernel reads ``hidden`` and ``weight`` (TMA descriptors when the layout allows, else raw
pointers with strides: any layout, masked H tail) and the logit map's arguments."""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from lce.backends.triton.config import TileShape, interpreting
from lce.options import LogitOptions


def _tma_ok(tensor: torch.Tensor) -> bool:
    """TMA needs a unit last stride and 16-byte aligned base and row stride."""
    row_bytes = tensor.stride(0) * tensor.element_size()
    return tensor.stride(1) == 1 and row_bytes % 16 == 0 and tensor.data_ptr() % 16 == 0


def operand_args(
    hidden: torch.Tensor, weight: torch.Tensor, tiles: TileShape, use_tma: bool
) -> dict[str, object]:
    """Keyword arguments shared by both kernels: the two operands, H, and how to load them.

    Under TMA the kernels read no stride and take only H's number of K tiles (the descriptors
    carry the layout and read zeros past H): the strides go as 0 and H rounded up to the K tile,
    so every TMA layout and H with that tile count share one compiled specialization (Triton
    keys a compile on each int's class: == 1, divisible by 16, other).
    """
    tma = use_tma and _tma_ok(hidden) and _tma_ok(weight)
    hidden_size = hidden.shape[1]
    strides = (*hidden.stride(), *weight.stride())
    if tma:
        hidden_size = -(-hidden_size // tiles.block_h) * tiles.block_h
        strides = (0, 1, 0, 1)
    args: dict[str, object] = {
        "H": hidden_size,
        **dict(zip(("stride_ht", "stride_hh", "stride_wv", "stride_wh"), strides, strict=True)),
        "USE_TMA": tma,
        # Read by the pointer loads only: fixed under TMA, so H does not pick another compile.
        "EVEN_H": tma or hidden.shape[1] % tiles.block_h == 0,
        "BF16_INTERPRETED": interpreting() and weight.dtype == torch.bfloat16,
    }
    if tma:
        args["hidden"] = TensorDescriptor.from_tensor(hidden, [tiles.block_t, tiles.block_h])
        args["weight"] = TensorDescriptor.from_tensor(weight, [tiles.block_v, tiles.block_h])
    else:
        args["hidden"], args["weight"] = hidden, weight
    return args


def map_args(logit: LogitOptions, bias: torch.Tensor | None) -> dict[str, object]:
    """The logit map's kernel arguments (`tiles.logit_map`), shared by every kernel's launch."""
    return {
        "centred_scale": logit.centred_scale,
        "cap_scale": logit.cap_scale,
        "HAS_BIAS": bias is not None,
        "SOFTCAP": logit.softcap is not None,
        "SMOOTHING": logit.label_smoothing > 0,
    }
