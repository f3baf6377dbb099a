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


# A CPU BLAS computes a product of fewer rows than this as dot products, each summed along the
# inner dimension in one sequence: with two rows and K = 32769 (a token chunk's d_logits times
# the weight) MKL's fp32 result was 252 u sum|a||b| off, against 6 with four rows. Such a product
# is summed in K blocks, each from zero, and the blocks' products then summed (9 u there).
SKINNY_ROWS = 4
K_BLOCK = 256


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` (same dtypes), a skinny CPU product summed in K blocks."""
    if a.is_cuda or a.shape[0] >= SKINNY_ROWS or a.shape[1] <= K_BLOCK:
        return torch.mm(a, b, out=out)
    whole = a.shape[1] // K_BLOCK * K_BLOCK
    blocks = a[:, :whole].unflatten(1, (-1, K_BLOCK)).transpose(0, 1)
    parts = torch.bmm(blocks, b[:whole].unflatten(0, (-1, K_BLOCK)))
    if whole < a.shape[1]:
        parts = torch.cat([parts, torch.mm(a[:, whole:], b[whole:])[None]])
    return torch.sum(parts, dim=0, out=out)


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` accumulated in fp32 (fp64 for fp64), rounded once into ``out``'s dtype."""
    if a.dtype not in LOW_PRECISION:
        _mm(a, b, out)
    elif not _native_fp32_out(a):
        # Row blocks bound the fp32 temporary of the upcast product.
        step = max(1, TEMP_BYTES // (4 * max(1, out.shape[1])))
        b32 = b.float()
        for start in range(0, out.shape[0], step):
            block = a[start : start + step].float()
            product = torch.empty(block.shape[0], b32.shape[1])
            out[start : start + step].copy_(_mm(block, b32, product))
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


# Rows of the first block `RowSum.result` rounds through a temporary (see there).
FIRST_ROUNDED_ROWS = 64


class RowSum:
    """A ``[rows, cols]`` sum of matrix products kept in fp32, rounded once to ``dtype`` at the end.

    For a 2-byte ``dtype`` the result's own memory holds the fp32 sums of its first ``rows // 2``
    rows and `result` rounds them in place, so sums and result take 4 bytes per element together:
    no fp32 ``[rows, cols]`` buffer beside a result allocated at the end. Other dtypes sum in the
    result itself (fp32; fp64 for fp64 operands).
    """

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> None:
        self._out = torch.zeros(rows, cols, dtype=dtype, device=device)
        self._parts: list[tuple[int, torch.Tensor]] = [(0, self._out)]
        if dtype.itemsize == 2:
            inside = rows // 2
            as_fp32 = self._out.view(-1)[: 2 * inside * cols].view(torch.float32)
            outside = torch.zeros(rows - inside, cols, dtype=torch.float32, device=device)
            self._parts = [(0, as_fp32.view(inside, cols)), (inside, outside)]

    def add(self, rows: slice, a: torch.Tensor, b: torch.Tensor) -> None:
        """``sum[rows] += a @ b`` (`addmm_`)."""
        for first, part in self._parts:
            lo, hi = max(rows.start, first), min(rows.stop, first + part.shape[0])
            if lo < hi:
                addmm_(part[lo - first : hi - first], a[lo - rows.start : hi - rows.start], b)

    def result(self) -> torch.Tensor:
        """The sum in ``dtype``, each element rounded once; call once, after the last `add`."""
        if len(self._parts) == 1:
            return self._out
        (_, inside), (first_outside, outside) = self._parts
        # Row r's fp32 sum sits at bytes [4rC, 4(r+1)C), its rounded value goes to [2rC, 2(r+1)C):
        # rows [a, b) with b <= 2a write only bytes already read, so blocks double in size; the
        # first block, whose writes overlap its own reads, goes through a small temporary.
        stop = min(FIRST_ROUNDED_ROWS, first_outside)
        self._out[:stop].copy_(inside[:stop].to(self._out.dtype))
        while stop < first_outside:
            start, stop = stop, min(2 * stop, first_outside)
            self._out[start:stop].copy_(inside[start:stop])
        self._out[first_outside:].copy_(outside)  # after: these rows' bytes held fp32 sums
        self._parts = [(0, self._out)]
        return self._out
