"""Run a driver on rank 0 of a torchrun world while every other rank serves its jobs.

    torchrun --nproc-per-node=4 --standalone -m verify.distributed.launch \\
        --driver verify.distributed.diagnostics:self_check [--device cuda] [-- DRIVER_ARGS]

The driver is ``fn(pool, argv) -> int`` with ``pool`` a `TorchrunPool` (same ``run``/``map`` as
`WorkerPool`). Ranks meet through ``env://`` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from verify.distributed import rendezvous
from verify.distributed.channels import StoreChannel
from verify.distributed.errors import PoolError
from verify.distributed.torchrun_pool import TorchrunPool
from verify.distributed.worker import load_function, serve


def main(argv: list[str] | None = None) -> int:
    """Join the world; rank 0 runs the driver and returns its exit code, the others serve."""
    parser = argparse.ArgumentParser(
        prog="python -m verify.distributed.launch", description=__doc__
    )
    parser.add_argument("--driver", required=True, help="package.module:function run on rank 0")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.add_argument("driver_args", nargs="*", help="passed to the driver after --")
    args = parser.parse_args(argv)
    store, rank, world_size = rendezvous.env_store()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    topology = rendezvous.join(store, rank, world_size, args.device, local_rank)
    if rank != 0:
        serve(StoreChannel(store, rank, driver_side=False), topology)
        rendezvous.leave()
        return 0
    driver = load_function(args.driver)
    pool = TorchrunPool(store, topology, timeout_s=args.timeout)
    try:
        code = int(driver(pool, args.driver_args) or 0)
    except PoolError:
        # Some ranks may sit in a collective forever: exit hard so torchrun ends the world.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    pool.close()
    rendezvous.leave()
    return code


if __name__ == "__main__":
    sys.exit(main())
