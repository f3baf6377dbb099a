"""How the operands an implementation multiplies are stored: contiguous, transposed or sliced.

`verify.cases.rank_inputs` stores each rank's inputs this way, and the baseline B multiplies the
same storage (a BLAS sums a transposed operand's dots in another order).
"""

from __future__ import annotations

import torch

from verify.cases.spec import CaseSpec


def operand_layouts(spec: CaseSpec) -> tuple[str, str]:
    """How `rank_inputs` stores the hidden and weight an implementation multiplies: a tied run's
    hidden (base + embedding, formed in the run) and an untied rerun's are contiguous."""
    tied = spec.tied or spec.transform == "untie"
    return ("contiguous" if tied else spec.layout), spec.layout


def with_layout(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as ``tensor`` stored ``contiguous``, ``transposed`` (last two dims) or
    ``sliced`` (a window of a wider buffer); both non-contiguous layouts keep autograd leaves."""
    if layout == "transposed" and tensor.dim() >= 2:
        return tensor.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "sliced":
        wide = torch.zeros(
            *tensor.shape[:-1], tensor.shape[-1] + 3, dtype=tensor.dtype, device=tensor.device
        )
        wide[..., 1:-2] = tensor
        return wide[..., 1:-2]
    return tensor.clone()
