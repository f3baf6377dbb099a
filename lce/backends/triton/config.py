"""Block sizes and numeric flags of the Triton kernels, chosen per run mode (interpreter or GPU)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

FP32_PRECISIONS = ("ieee", "tf32")


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``, read at call time)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class TileShape:
    """One kernel's tile: ``block_t`` tokens x ``block_v`` vocab rows, H stepped by ``block_h``.

    ``group`` token tiles are scheduled side by side so they share weight tiles in L2.
    ``max_registers`` caps registers per thread (Triton's ``maxnreg``), e.g. so two programs fit
    on one SM and one's epilogue overlaps the other's matmul; None lets the compiler choose.
    ``block_h_fp32``: ``block_h`` for 4-byte (fp32) operands, whose tiles take twice the shared
    memory of bf16 ones; None keeps ``block_h``. See `for_dtype`.
    """

    block_t: int
    block_v: int
    block_h: int
    group: int = 8
    num_warps: int = 8
    num_stages: int = 3
    max_registers: int | None = None
    block_h_fp32: int | None = None

    def for_dtype(self, dtype: torch.dtype) -> TileShape:
        """The tile a kernel runs for operands of ``dtype`` (``block_h_fp32`` applied to fp32)."""
        if dtype != torch.float32 or self.block_h_fp32 is None:
            return self
        return dataclasses.replace(self, block_h=self.block_h_fp32, block_h_fp32=None)

    def launch_options(self) -> dict[str, int]:
        """Keyword arguments of a kernel launch besides the kernel's own."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options

    def __post_init__(self) -> None:
        for name in ("block_t", "block_v", "block_h", "block_h_fp32"):
            size = getattr(self, name)
            if name == "block_h_fp32" and size is None:
                continue
            if size < 16 or size & (size - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {size}")
        if self.group < 1:
            raise ValueError(f"group must be >= 1, got {self.group}")


@dataclass(frozen=True)
class TritonConfig:
    """Everything the Triton stages can be tuned with.

    ``tiles_per_program``: vocab tiles one forward program sweeps with its online softmax (the
    forward workspace is ``4 * T * ceil(V / (block_v * tiles_per_program))`` fp32).
    ``chunk_bytes``: most bytes of one backward ``[T, chunk]`` d_logits chunk (weight's dtype).
    It lies in grad_weight's rows not written yet while they hold it, then the narrower
    ``tail_chunk_bytes`` chunks take the rest in a buffer of their own (see
    `stages._dlogits_chunks`); without such rows (no grad_weight, fp32 grad_weight, several
    token blocks) every chunk is ``chunk_bytes`` in one buffer. The backward's peak is then
    grad_weight + grad_hidden's fp32 sums (4 bytes per element, the bf16 result included) + the
    tail buffer: 1.08x the gradients at llama3-8k on an H200, where a ``chunk_bytes`` buffer of
    its own gave 1.18x (H100: 256, 128 and 64 MiB gave 1.30x, 1.18x and 1.12x at 54.8, 55.5 and
    57.3 ms).
    ``aliased_chunk_bytes``: most bytes of a d_logits chunk that lies in grad_weight's rows (no
    memory of its own, so wider costs no peak): fewer chunks mean fewer fp32 read-and-write passes
    over grad_hidden's sums and fewer kernel tails. Never below ``chunk_bytes``. On an H100 the
    backward took 86.7 / 80.5 ms at 128 MiB / 1 GiB for qwen2.5-16k (49 / 27 chunks), 48.0 / 46.7
    ms for gemma2-8k, 38.5 / 38.9 ms for llama3-8k, same peak (benchmarks/kernel_gpu.py's
    breakdown).
    ``backward_capped``: the backward's tile when the logits are softcapped, or None for
    ``backward``. The cap's slope is a second fp32 value per lane that lives through the
    epilogue; at 128 x 256 it spilled 242 registers (H100, gemma2-8k). Its ``block_v`` divides
    ``backward``'s, which sizes the chunks.
    ``fp32_precision``: ``tl.dot`` mode for fp32 inputs; ``ieee`` (default) matches an fp32
    reference, ``tf32`` is faster and ~3e-4 relative. Low-precision inputs ignore it; the
    backward's cuBLAS GEMMs follow ``torch.backends.cuda.matmul.allow_tf32`` instead.
    ``use_tma``: load tiles through TMA descriptors where the layout allows (16-byte aligned rows,
    unit last stride); other layouts use pointer loads either way.
    ``persistent``: launch one forward program per SM (two under the interpreter), each walking
    (token tile, split) items; compiled with TMA loads it is warp-specialized, so the loads of one
    item overlap the softmax epilogue of the last (H100 llama3-8k: 13.1 vs 13.9 ms, one GEMM
    11.8). False launches one program per item.
    ``loss_chunk_bytes``: most bytes of a logits chunk of the 3-GEMM loss (`loss_pass`), unless
    ``loss_peak_grads`` allows more: the chunk may take what that multiple of the call's gradient
    bytes (``(T + V_local) * H`` in weight's dtype) leaves beside the pass's fp32 grad_hidden
    (``4 * T * H``), so the pass's peak stays near it. Each chunk adds its grad_weight to the fp32
    buffer, one read and write of ``[V_local, H]``: fewer chunks, less traffic. On an H100 at
    gemma2-8k (``grad_weight_into``, interleaved rounds): 4 chunks of 2048 rows 49.7 ms, peak
    1.05 GiB; 3 of 2816 47.6 ms, 1.41 GiB (the gradients: 1.13 GiB). 0 (the interpreter's):
    ``loss_chunk_bytes`` alone.
    ``grad_weight_fp32``: False (default; the StageBackend contract allows it) returns grad_weight
    in weight's dtype, written by cuBLAS from its fp32 accumulator (`gemm.fp32_reductions`): the
    single rounding autograd's cast to weight's dtype would make, without a ``[V_local, H]`` fp32
    buffer (2 GiB at llama3-8k). True returns the fp32 product, for a caller that accumulates it
    in fp32 itself.
    """

    forward: TileShape
    backward: TileShape
    backward_capped: TileShape | None = None
    tiles_per_program: int = 8
    chunk_bytes: int = 128 << 20
    tail_chunk_bytes: int = 16 << 20
    aliased_chunk_bytes: int = 1 << 30
    fp32_precision: str = "ieee"
    use_tma: bool = True
    grad_weight_fp32: bool = False
    persistent: bool = True
    loss_chunk_bytes: int = 5 << 28
    loss_peak_grads: float = 0.0

    def __post_init__(self) -> None:
        if self.fp32_precision not in FP32_PRECISIONS:
            raise ValueError(
                f"fp32_precision must be one of {FP32_PRECISIONS}, got {self.fp32_precision!r}"
            )
        if self.tiles_per_program < 1:
            raise ValueError(f"tiles_per_program must be >= 1, got {self.tiles_per_program}")
        sizes = ("chunk_bytes", "tail_chunk_bytes", "aliased_chunk_bytes", "loss_chunk_bytes")
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.loss_peak_grads < 0:
            raise ValueError(f"loss_peak_grads must be >= 0, got {self.loss_peak_grads}")
        capped = self.backward_capped
        if capped is not None and self.backward.block_v % capped.block_v:
            raise ValueError(
                f"backward_capped.block_v ({capped.block_v}) must divide backward.block_v "
                f"({self.backward.block_v}), which sizes the backward's chunks"
            )

    def backward_tile(self, softcap: bool) -> TileShape:
        """The backward's tile for logits with or without a softcap."""
        if softcap and self.backward_capped is not None:
            return self.backward_capped
        return self.backward


# The interpreter pays ~10 ms per program step whatever the block size: few, large tiles.
INTERPRETER_CONFIG = TritonConfig(
    forward=TileShape(block_t=64, block_v=256, block_h=64, num_warps=4, num_stages=1),
    backward=TileShape(block_t=64, block_v=256, block_h=64, num_warps=4, num_stages=1),
    tiles_per_program=4,
    chunk_bytes=1 << 20,
    loss_chunk_bytes=1 << 20,
)

# Hopper (H100/H200) bf16, picked by benchmarks/kernel_gpu.py's sweep (see docs/bench/triton.md).
# fp32 operands at block_h=64 need 256 KiB of shared memory in the forward (TMA loads, compiled
# for sm_90 by triton 3.9), over Hopper's 227 KiB per block; block_h=32 needs 128 KiB.
# tests/lce/test_triton_resources.py compiles every dtype and checks the sizes.
GPU_CONFIG = TritonConfig(
    forward=TileShape(
        block_t=128, block_v=256, block_h=64, group=16, num_warps=8, num_stages=3, block_h_fp32=32
    ),
    # 128x256 s3 on an H100: 38.1 vs 39.8 ms for the whole backward (128x128 s4, the pick of the
    # 2026-11-22 H200 sweep) at llama3-8k, same bits.
    backward=TileShape(
        block_t=128, block_v=256, block_h=64, group=16, num_warps=8, num_stages=3, block_h_fp32=32
    ),
    # Half as wide: no spills (123 registers); 3 stages (96 KiB of shared memory) leave room for
    # a second program per SM. Softcap 30 at gemma2-8k on an H100, mean loss fwd+bwd: 67.7 ms,
    # 70.5 with 4 stages and the slope from q, 88.0 with the 128 x 256 tile (docs/BENCHMARKS.md).
    backward_capped=TileShape(
        block_t=128, block_v=128, block_h=64, group=16, num_warps=8, num_stages=3, block_h_fp32=32
    ),
    tiles_per_program=1,
    # Issue 33's peak target for the 3-GEMM loss is 1.5x the gradients; 0.05 of it is left for
    # the per-token statistics and the merge's temporaries.
    loss_peak_grads=1.45,
)


def default_config() -> TritonConfig:
    """Large tiles under the interpreter, the tuned GPU tiles otherwise."""
    return INTERPRETER_CONFIG if interpreting() else GPU_CONFIG
