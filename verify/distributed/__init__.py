"""Persistent torch.distributed worker pools (gloo on CPU, NCCL on CUDA) that run TP=1/2/4 jobs.

The driver (the only process running Hypothesis) sends a ``"module:function"`` job and a picklable
payload; every rank of a TP subgroup builds its own tensors from the payload and returns a result.
"""

from verify.distributed.errors import PoolError, WorkerDied, WorkerError, WorkerHung
from verify.distributed.pool import WorkerPool
from verify.distributed.seam import Pool, open_pool
from verify.distributed.worker import JobContext

__all__ = [
    "JobContext",
    "Pool",
    "PoolError",
    "WorkerDied",
    "WorkerError",
    "WorkerHung",
    "WorkerPool",
    "open_pool",
]
