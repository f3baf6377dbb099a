"""Backward stage, part 2: the two gradient GEMMs with fp32 results from low-precision operands.

On CUDA, cuBLAS accumulates in fp32 and writes fp32 directly (``out_dtype``); elsewhere the
operands are upcast (exact) and multiplied in fp32.
"""

from __future__ import annotations

import torch


def _native_fp32_out(a: torch.Tensor) -> bool:
    return a.is_cuda and a.dtype in (torch.float16, torch.bfloat16)


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` written in place; ``out`` is fp32 or the operands' dtype."""
    if a.dtype == out.dtype:
        torch.mm(a, b, out=out)
    elif _native_fp32_out(a):
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a.float(), b.float(), out=out)


def addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32; one fp32 rounding of the product per call."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif _native_fp32_out(a):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())
