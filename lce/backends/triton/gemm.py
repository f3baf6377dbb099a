"""Backward stage, part 2: the two gradient GEMMs, accumulated in fp32 from low-precision operands.

On CUDA, cuBLAS accumulates in fp32 and writes fp32 directly (``out_dtype``); elsewhere the
operands are upcast (exact) and multiplied in fp32. A low-precision result is rounded once from
that fp32 product: a bf16-output cuBLAS GEMM may reduce partial sums in bf16 (measured up to 40%
off on small shapes), so it is not used.
"""

from __future__ import annotations

import torch

# Bound of the fp32 temporary when the result is written in low precision.
TEMP_BYTES = 64 << 20


def _native_fp32_out(a: torch.Tensor) -> bool:
    return a.is_cuda and a.dtype in (torch.float16, torch.bfloat16)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if _native_fp32_out(a):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` accumulated in fp32, rounded once into ``out``'s dtype."""
    if out.dtype != torch.float32:
        # Whole 256-row blocks: cuBLAS picked a ~3x slower kernel for M = 4681 (H200).
        step = max(256, TEMP_BYTES // (4 * out.shape[1]) // 256 * 256)
        for start in range(0, out.shape[0], step):
            rows = slice(start, start + step)
            out[rows].copy_(_mm_fp32(a[rows], b))
    elif a.dtype == torch.float32:
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
