"""Triton backend of lce: fused logits-tile kernels on one vocab shard (``backend="triton"``).

Runs compiled on CUDA, or on the CPU under ``TRITON_INTERPRET=1`` (set before triton is imported).
"""

from lce.backends.triton.config import TileShape, TritonConfig, default_config
from lce.backends.triton.stages import TritonStages

__all__ = ["TileShape", "TritonConfig", "TritonStages", "default_config"]
