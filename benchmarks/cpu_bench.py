"""CPU benchmark of the torch backend: time and peak memory of fp32 forward+backward (mean loss).

Each method runs in a fresh subprocess (peak RSS is per process); all methods in one invocation, so
the ratios compare like with like. Prints a table and writes JSON.

    python benchmarks/cpu_bench.py [--tokens 4096 --hidden 1024 --vocab 32000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from verify.numerics.reference import IGNORE_INDEX

METHODS = ("materialized", "torch_lce_reference", "torch_lce_chunked_512", "lce_torch")


def _rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize() / 2**20


def _loss(method: str, hidden, weight, targets):
    if method == "materialized":
        return F.cross_entropy(hidden @ weight.T, targets)
    if method == "torch_lce_reference":
        return F.linear_cross_entropy(hidden, weight, targets)
    if method == "torch_lce_chunked_512":
        options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=512)
        return F.linear_cross_entropy(hidden, weight, targets, options=options)
    import lce

    return lce.linear_cross_entropy(hidden, weight, targets, backend="torch")


def measure(method: str, tokens: int, hidden_size: int, vocab: int, repeats: int) -> dict:
    """Run in this process: median fwd+bwd seconds and peak RSS above the inputs (MiB)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[::17] = IGNORE_INDEX
    start_rss = _rss_mib()
    times = []
    for _ in range(repeats):
        hidden.grad = weight.grad = None
        began = time.perf_counter()
        _loss(method, hidden, weight, targets).backward()
        times.append(time.perf_counter() - began)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    return {"method": method, "seconds": statistics.median(times), "peak_mib": peak - start_rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/cpu_bench.json"))
    parser.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()
    shape = (args.tokens, args.hidden, args.vocab, args.repeats)
    if args.one:
        print(json.dumps(measure(args.one, *shape)))
        return
    rows = []
    for method in METHODS:
        cmd = [sys.executable, __file__, "--one", method, "--tokens", str(args.tokens)]
        cmd += ["--hidden", str(args.hidden), "--vocab", str(args.vocab)]
        cmd += ["--repeats", str(args.repeats)]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    peer = next(r for r in rows if r["method"] == "torch_lce_chunked_512")
    print(f"T={args.tokens} H={args.hidden} V={args.vocab} fp32 fwd+bwd, torch {torch.__version__}")
    print(f"{'method':<24}{'seconds':>10}{'peak MiB':>10}{'time/peer':>11}{'peak/peer':>11}")
    for row in rows:
        row["time_vs_chunked_peer"] = row["seconds"] / peer["seconds"]
        row["peak_vs_chunked_peer"] = row["peak_mib"] / peer["peak_mib"]
        print(
            f"{row['method']:<24}{row['seconds']:>10.2f}{row['peak_mib']:>10.0f}"
            f"{row['time_vs_chunked_peer']:>11.2f}{row['peak_vs_chunked_peer']:>11.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
    }
    args.out.write_text(json.dumps({"shape": shape[:3], "meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
