"""Shared memory of the Triton kernels at `GPU_CONFIG`, compiled for Hopper (sm_90) without a GPU.

    python tests/helpers/triton_shared_memory.py   # JSON: [{kernel, dtype, loads, block_h, shared}]

Run in a process without ``TRITON_INTERPRET`` (the kernels must be JIT functions, not
interpreted ones); `tests/lce/test_triton_resources.py` does that.
"""

from __future__ import annotations

import json

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lce.backends.triton.backward_kernel import _dlogits_kernel
from lce.backends.triton.config import GPU_CONFIG, TileShape
from lce.backends.triton.forward_kernel import (
    MERGE_BLOCK_S,
    MERGE_BLOCK_T,
    _forward_partials_kernel,
    _merge_partials_kernel,
    warp_specialized,
)
from lce.backends.triton.loss_kernels import BLOCK_V, _row_dlogits_kernel, _row_stats_kernel
from lce.backends.triton.target_kernel import (
    BLOCK_T,
    PLACE_BLOCK_T,
    _place_target_kernel,
    _target_logits_kernel,
)

HOPPER = GPUTarget("cuda", 90, 32)
TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
CONSTEXPRS = ("BLOCK_T", "BLOCK_V", "BLOCK_H", "GROUP", "EVEN_H", "BF16_INTERPRETED", "PRECISION",
              "USE_TMA", "WARP_SPECIALIZE", "V_DIV16", "C_DIV16", "HAS_BIAS", "SOFTCAP",
              "SMOOTHING", "ENTROPY")  # fmt: skip
FLOATS = ("centred_scale", "cap_scale", "dlogit_scale")
# The logit map's switches (`lce.options.LogitOptions`; and the row d_logits kernel's entropy
# term, kept logits' backward): every one off, and every one on (bf16
# with TMA loads only: the options' code is the same for every dtype and load path, and each
# compile of a tiled kernel takes ~10-20 s).
OPTIONS = {"plain": False, "options": True}


def argument_type(name: str, tile: TileShape, dtype: str, tma: bool) -> str:
    """Triton signature type of one kernel argument, by the kernels' naming conventions."""
    if name in CONSTEXPRS:
        return "constexpr"
    if name in ("hidden", "weight"):
        rows = tile.block_t if name == "hidden" else tile.block_v
        return f"tensordesc<{dtype}[{rows}, {tile.block_h}]>" if tma else f"*{dtype}"
    if name in ("dlogits_ptr", "logits_ptr", "out_ptr", "bias_ptr"):
        return f"*{dtype}"
    if name == "targets_ptr":
        return "*i64"
    if name.endswith("_ptr"):
        return "*fp32"
    return "fp32" if name in FLOATS else "i32"


def shared_bytes(kernel, tile: TileShape, dtype: torch.dtype, tma: bool, options: bool) -> int:
    """Bytes of shared memory one program of ``kernel`` takes at ``tile``, compiled for sm_90,
    with the logit map's ``options`` (bias, softcap, label smoothing) all on or all off."""
    tile = tile.for_dtype(dtype)
    names = kernel.arg_names
    signature = {n: argument_type(n, tile, TRITON_TYPES[dtype], tma) for n in names}
    values = {
        "BLOCK_T": tile.block_t, "BLOCK_V": tile.block_v, "BLOCK_H": tile.block_h,
        "GROUP": tile.group, "EVEN_H": True, "BF16_INTERPRETED": False, "PRECISION": "ieee",
        "USE_TMA": tma, "WARP_SPECIALIZE": warp_specialized(GPU_CONFIG, tma),
        "V_DIV16": True, "C_DIV16": True, "HAS_BIAS": options, "SOFTCAP": options,
        "SMOOTHING": options,
    }  # fmt: skip
    constexprs = {(names.index(n),): v for n, v in values.items() if n in names}
    options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    source = ASTSource(kernel, signature, constexprs)
    return triton.compile(source, target=HOPPER, options=options).metadata.shared


def main() -> None:
    rows = []
    # The capped backward tile (`TritonConfig.backward_capped`) runs only with a softcap: every
    # dtype and load path with the options on.
    tiled = (("_forward_partials_kernel", _forward_partials_kernel, GPU_CONFIG.forward, OPTIONS),
             ("_dlogits_kernel", _dlogits_kernel, GPU_CONFIG.backward, OPTIONS),
             ("_dlogits_kernel capped", _dlogits_kernel, GPU_CONFIG.backward_capped,
              {"options": True}))  # fmt: skip
    for label, kernel, tile, switches in tiled:
        for dtype in TRITON_TYPES:
            for tma in (True, False):
                for name, options in switches.items():
                    if (
                        options
                        and tile is not GPU_CONFIG.backward_capped
                        and (dtype != torch.bfloat16 or not tma)
                    ):
                        continue
                    rows.append({
                        "kernel": label, "dtype": str(dtype),
                        "loads": "tma" if tma else "ptr", "options": name,
                        "block_h": tile.for_dtype(dtype).block_h,
                        "shared": shared_bytes(kernel, tile, dtype, tma, options),
                    })  # fmt: skip
    rows += row_kernel_sizes()
    print(json.dumps(rows))


def row_kernel_sizes() -> list[dict]:
    """The per-token kernels (split merge, the 3-GEMM loss's rows, the target lane's dot and
    placement), bf16 (the target's dot in every dtype: its fp32 dot takes another path), compiled
    with the logit map's switches off and on: the interpreter accepts code the compiler rejects."""
    bf16 = (torch.bfloat16,)
    target = {"BLOCK_T": BLOCK_T, "BLOCK_H": GPU_CONFIG.forward.block_h,
              "BF16_INTERPRETED": False, "PRECISION": "ieee"}  # fmt: skip
    kernels = (
        (_merge_partials_kernel, {"BLOCK_T": MERGE_BLOCK_T, "BLOCK_S": MERGE_BLOCK_S}, bf16),
        (_row_stats_kernel, {"BLOCK_V": BLOCK_V}, bf16),
        (_row_dlogits_kernel, {"BLOCK_V": BLOCK_V, "BF16_INTERPRETED": False}, bf16),
        (_target_logits_kernel, target, tuple(TRITON_TYPES)),
        (_place_target_kernel, {"BLOCK_T": PLACE_BLOCK_T}, bf16),
    )
    rows = []
    for kernel, values, dtypes in kernels:
        for dtype in dtypes:
            rows += _row_kernel_sizes(kernel, values, dtype)
    return rows


def _row_kernel_sizes(kernel, values: dict, dtype: torch.dtype) -> list[dict]:
    """`row_kernel_sizes`' rows of one kernel and dtype."""
    rows = []
    names = kernel.arg_names
    for name, options in OPTIONS.items():
        switches = {
            "HAS_BIAS": options, "SOFTCAP": options, "SMOOTHING": options, "ENTROPY": options,
        }  # fmt: skip
        fixed = {n: v for n, v in {**values, **switches}.items() if n in names}
        type_name = TRITON_TYPES[dtype]
        signature = {n: argument_type(n, GPU_CONFIG.forward, type_name, False) for n in names}
        signature.update({n: "constexpr" for n in fixed})
        constexprs = {(names.index(n),): v for n, v in fixed.items()}
        source = ASTSource(kernel, signature, constexprs)
        shared = triton.compile(source, target=HOPPER, options={"num_warps": 8}).metadata.shared
        row = {"kernel": kernel.__name__, "dtype": str(dtype), "loads": "rows"}
        rows.append({**row, "options": name, "block_h": 0, "shared": shared})
    return rows


if __name__ == "__main__":
    main()
