"""The backward's gradient GEMMs, accumulated in fp32 from low-precision operands (both backends).

On CUDA, cuBLAS accumulates in fp32 and writes either fp32 (``out_dtype``) or the operands' dtype,
with its split-K partial sums reduced in fp32 (`fp32_reductions`), so a low-precision result is the
one rounding of the fp32 product. Elsewhere the operands are upcast (exact) and multiplied in fp32.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Bound of the fp32 temporary when the result is written in low precision off CUDA.
TEMP_BYTES = 64 << 20


LOW_PRECISION = (torch.float16, torch.bfloat16)


def _native_fp32_out(a: torch.Tensor) -> bool:
    return a.is_cuda and a.dtype in LOW_PRECISION


@contextmanager
def fp32_reductions() -> Iterator[None]:
    """cuBLAS fp16/bf16 GEMMs inside reduce split-K partial sums in fp32, not in the output dtype.

    PyTorch's default allows reduced-precision reductions: a split-K GEMM may then add its partial
    sums in bf16, each addition one more rounding. The flags are process-wide; this restores them
    on exit (not thread-safe against GEMMs on another thread meanwhile).
    """
    matmul = torch.backends.cuda.matmul
    saved = (
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
    )
    matmul.allow_bf16_reduced_precision_reduction = False
    matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        (
            matmul.allow_bf16_reduced_precision_reduction,
            matmul.allow_fp16_reduced_precision_reduction,
        ) = saved


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` accumulated in fp32 (fp64 for fp64), rounded once into ``out``'s dtype."""
    if a.dtype not in LOW_PRECISION:
        torch.mm(a, b, out=out)
    elif not _native_fp32_out(a):
        # Row blocks bound the fp32 temporary of the upcast product.
        step = max(1, TEMP_BYTES // (4 * max(1, out.shape[1])))
        b32 = b.float()
        for start in range(0, out.shape[0], step):
            rows = slice(start, start + step)
            out[rows].copy_(torch.mm(a[rows].float(), b32))
    elif out.dtype == torch.float32:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        with fp32_reductions():
            torch.mm(a, b, out=out)


def addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 (or fp64 with fp64 operands); products summed in fp32."""
    if a.dtype not in LOW_PRECISION:
        acc.addmm_(a, b)
    elif _native_fp32_out(a):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())
