"""How much of each path's time after a host sync is spent waiting on the host (issue 33).

`kernel_gpu.py --timing synced` times every call after a sync, as a plain benchmark loop does: the
GPU idles while Python prepares the call's first kernels. In a training step the host is usually
ahead (the layers before the LM head still run), so that wait is hidden. Here every row is timed
both ways in the same interleaved rounds: after a sync, and queued behind ``--load-ms`` of GEMMs
(`rounds.BehindLoad`: the host then enqueues the call while the GPU works). The difference is
the GPU's wait on the host. (Until session 13 the call was queued behind a low-power GPU spin,
after which an H100, which runs these loads at its power cap, ran every kernel ~8% faster: at
llama3-8k the per-token path's 4.6 ms "wait" was 0.9 ms before its first kernel and 3.7 ms of
faster kernels, and four cuBLAS GEMMs "waited" 4 ms.)

    PYTHONPATH=. python benchmarks/host_overhead.py --json host.json [--shapes llama3-8k]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import kernel_gpu as kg  # this script's folder is on sys.path
import torch
from rounds import BehindLoad, Rounds, event_ms

ROUNDS = 9


class Ahead:
    """A call to time queued behind the GEMM load (see `Timing`)."""

    def __init__(self, call: Callable[[], object]) -> None:
        self.call = call

    def __call__(self) -> object:
        return self.call()


class Timing:
    """The rounds' timer: an `Ahead` call behind the GEMM load, any other right after a sync."""

    def __init__(self, load_ms: float) -> None:
        self.behind_load = BehindLoad(load_ms)

    def __call__(self, call: Callable[[], object]) -> float:
        return self.behind_load(call) if isinstance(call, Ahead) else event_ms(call)


def paths(inp: dict, main_grad: torch.Tensor) -> dict[str, tuple[str, Callable[[], object]]]:
    """The rows: (mode, call) by method, lce's paths beside stock PyTorch and one GEMM."""

    def forward() -> object:
        return kg.lce.token_logprobs(inp["hidden"], inp["weight"], inp["targets"], backend="triton")

    return {
        kg.kernel_targets.GEMM: ("fwd", lambda: inp["hidden"] @ inp["weight"].T),
        "stock PyTorch": ("token", kg.grads_of(kg.stock_loss, inp, "token")),
        "stock PyTorch, mean": ("mean", kg.grads_of(kg.stock_loss, inp, "mean")),
        "lce triton, forward": ("fwd", forward),
        "lce triton": ("token", kg.grads_of(kg.lce_loss, inp, "token")),
        "lce triton, mean": ("mean", kg.grads_of(kg.lce_loss, inp, "mean")),
        "lce triton, fast (3 GEMMs)": ("mean", kg.grads_of(kg.lce_fast_loss, inp, "mean")),
        "lce triton, 3 GEMMs into main_grad": ("mean", kg.main_grad_run(inp, main_grad)),
        "lce triton, kept logits (3 GEMMs)": ("mean", kg.grads_of(kg.lce_kept_loss, inp, "mean")),
    }


def bench_shape(shape: str, load_ms: float) -> list[dict]:
    """Each path's median ms after a sync and with the host ahead, and the GPU's wait between."""
    inp = kg.make_inputs(*kg.SHAPES[shape])
    main_grad = torch.zeros(inp["weight"].shape, dtype=torch.float32, device="cuda")
    table = Rounds(Timing(load_ms))
    pairs = []
    for method, (mode, call) in paths(inp, main_grad).items():
        call()  # compile and warm up
        synced = table.add({"method": method, "mode": mode, "timing": "after sync"}, call)
        ahead = table.add(
            {"method": method, "mode": mode, "timing": "host ahead"},
            Ahead(call),
        )
        pairs.append((synced, ahead))
    table.time(ROUNDS)
    rows = []
    for synced, ahead in pairs:
        row = {"shape": shape, "method": synced["method"], "mode": synced["mode"]}
        row |= {"synced_ms": synced.get("ms"), "ahead_ms": ahead.get("ms")}
        row |= {"synced_round_ms": synced.get("round_ms"), "ahead_round_ms": ahead.get("round_ms")}
        if row["synced_ms"] is not None and row["ahead_ms"] is not None:
            row["host_wait_ms"] = row["synced_ms"] - row["ahead_ms"]
        row["error"] = synced.get("error") or ahead.get("error")
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    print("| shape | method | mode | after sync ms | host ahead ms | GPU waits on host ms |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        cells = [f"{row[k]:.2f}" if row.get(k) is not None else "-"
                 for k in ("synced_ms", "ahead_ms", "host_wait_ms")]  # fmt: skip
        print(f"| {row['shape']} | {row['method']} | {row['mode']} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write all numbers")
    parser.add_argument("--shapes", default="llama3-8k,gemma2-8k", help="kernel_gpu.SHAPES keys")
    parser.add_argument(
        "--load-ms", type=float, default=20.0, help="GEMMs before each 'host ahead' call"
    )
    args = parser.parse_args()
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(env | {"lce": kg.lce.__file__}, flush=True)  # which tree's lce an A/B imported
    report: dict = {"env": env}
    report |= {"load_ms": args.load_ms, "rounds": ROUNDS, "rows": []}
    for shape in args.shapes.split(","):
        report["rows"] += bench_shape(shape, args.load_ms)
        torch.cuda.empty_cache()
    print_rows(report["rows"])
    for shape in args.shapes.split(","):
        by = {(r["method"], r["mode"]): r for r in report["rows"] if r["shape"] == shape}
        lce, stock = by.get(("lce triton", "token")), by.get(("stock PyTorch", "token"))
        if lce and stock and not (lce["error"] or stock["error"]):
            synced, ahead = (lce[k] / stock[k] for k in ("synced_ms", "ahead_ms"))
            print(f"{shape}: per-token, lce / stock: {synced:.2f}x after a sync, {ahead:.2f}x "
                  "with the host ahead")  # fmt: skip
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
