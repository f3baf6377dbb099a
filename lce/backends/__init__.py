"""Backend registry: maps ``backend=`` names to a `StageBackend` for the given device."""

from __future__ import annotations

import importlib.util
import os

import torch

from lce.backends.base import ShardStats, StageBackend
from lce.backends.torch_chunked import TorchChunkedStages

BACKENDS = ("auto", "torch", "triton")

__all__ = ["BACKENDS", "ShardStats", "StageBackend", "get_stages", "resolve_backend_name"]


def _triton_usable(device: torch.device) -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend_name(
    backend: str, device: torch.device, dtype: torch.dtype | None = None
) -> str:
    """``auto`` is ``triton`` on CUDA when triton is installed (and inputs are not float64),
    else ``torch``. ``dtype`` is the weight's: the Triton kernels compute in fp32 at most."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        triton_ok = device.type == "cuda" and _triton_usable(device) and dtype != torch.float64
        return "triton" if triton_ok else "torch"
    if backend == "triton" and dtype == torch.float64:
        raise ValueError(
            "backend='triton' computes in fp32 and does not take float64 weight/hidden; "
            "use backend='torch' (or 'auto') for float64"
        )
    if backend == "triton" and not _triton_usable(device):
        raise ValueError(
            "backend='triton' needs the triton package and CUDA tensors, or TRITON_INTERPRET=1 "
            f"set before triton is imported to run on {device.type} tensors; "
            "use backend='torch' instead"
        )
    return backend


def get_stages(backend: str, device: torch.device, chunk_size: int | None) -> StageBackend:
    """The stage implementation for ``backend`` (already resolved) on ``device``."""
    if backend == "torch":
        return TorchChunkedStages(chunk_size)
    from lce.backends.triton import TritonStages

    return TritonStages(chunk_size=chunk_size)
