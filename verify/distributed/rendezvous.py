"""Join a torch.distributed world and make every TP subgroup once, for local pools and torchrun.

A local pool meets through a `FileStore` in a fresh temporary directory (no ports, so parallel pools
never collide); torchrun ranks meet through ``env://``. Both end in the same `join`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# The driver is the watchdog (per-job timeouts); this only bounds a collective nobody watches.
_COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def tp_sizes(world_size: int) -> tuple[int, ...]:
    """TP degrees a world offers: every divisor of ``world_size`` (1, 2, 4 for a world of 4)."""
    return tuple(k for k in range(1, world_size + 1) if world_size % k == 0)


def tp_slots(world_size: int, tp: int) -> list[tuple[int, ...]]:
    """The disjoint TP=``tp`` subgroups, as global ranks: ``[(0..tp-1), (tp..2tp-1), ...]``."""
    return [tuple(range(start, start + tp)) for start in range(0, world_size, tp)]


@dataclass(frozen=True)
class Topology:
    """This rank's place in the world: its device and, per TP degree, its subgroup and its ranks."""

    rank: int
    world_size: int
    device: torch.device
    groups: dict[int, tuple[dist.ProcessGroup, tuple[int, ...]]]


def file_store(path: str, world_size: int) -> dist.Store:
    """A store backed by one file; ``path`` must be new for every world (use a fresh dir)."""
    return dist.FileStore(path, world_size)


def env_store() -> tuple[dist.Store, int, int]:
    """The ``env://`` store torchrun sets up (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise RuntimeError(f"{name} is not set: launch with torchrun (env:// rendezvous)")
    store, rank, world_size = next(dist.rendezvous("env://"))
    return store, rank, world_size


def join(store: dist.Store, rank: int, world_size: int, device: str, local_rank: int) -> Topology:
    """Initialize the default group (gloo on CPU; NCCL plus gloo on CUDA) and all TP subgroups.

    Every rank calls `dist.new_group` for every subgroup in the same order, as torch requires.
    """
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        where = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"  # CPU tensors in a job still have a backend
    else:
        where = torch.device("cpu")
        backend = "gloo"
    prefixed = dist.PrefixStore("pg", store)
    dist.init_process_group(
        backend, store=prefixed, rank=rank, world_size=world_size, timeout=_COLLECTIVE_TIMEOUT
    )
    groups: dict[int, tuple[dist.ProcessGroup, tuple[int, ...]]] = {}
    for tp in tp_sizes(world_size):
        for ranks in tp_slots(world_size, tp):
            group = dist.new_group(list(ranks), timeout=_COLLECTIVE_TIMEOUT)
            if rank in ranks:
                groups[tp] = (group, ranks)
    return Topology(rank=rank, world_size=world_size, device=where, groups=groups)


def leave() -> None:
    """Destroy every process group of this process (the clean end of a worker)."""
    if dist.is_initialized():
        dist.destroy_process_group()
