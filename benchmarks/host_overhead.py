"""How much of each path's time after a host sync is spent waiting on the host (issue 33).

`kernel_gpu.py` times every call after a sync, as a benchmark loop does: the GPU idles while Python
prepares the call's first kernels. In a training step the host is usually ahead (the layers before
the LM head still run), so that wait is hidden. Here every row is timed both ways in the same
interleaved rounds: after a sync, and queued behind a GPU spin of ``--ahead-ms`` (the host then
enqueues the whole call before the GPU reaches it). The difference is the GPU's wait on the host.

    PYTHONPATH=. python benchmarks/host_overhead.py --json host.json [--shapes llama3-8k]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import kernel_gpu as kg  # this script's folder is on sys.path
import torch
from rounds import Rounds, event_ms

ROUNDS = 9


class Ahead:
    """A call to time queued behind a GPU spin (see `spin_then_time`)."""

    def __init__(self, call: Callable[[], object], cycles: int) -> None:
        self.call, self.cycles = call, cycles

    def __call__(self) -> object:
        return self.call()


def spin_then_time(call: Callable[[], object]) -> float:
    """`rounds.event_ms` of ``call``; an `Ahead` call starts behind its GPU spin."""
    if isinstance(call, Ahead):
        torch.cuda.synchronize()
        torch.cuda._sleep(call.cycles)
    return event_ms(call)


def cycles_per_ms() -> float:
    """The GPU spin's cycles per ms, measured (the spin counts SM clock cycles)."""
    probe = 10_000_000
    torch.cuda._sleep(probe)  # warm-up
    return probe / event_ms(lambda: torch.cuda._sleep(probe))


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


def bench_shape(shape: str, ahead_ms: float, cycles: float) -> list[dict]:
    """Each path's median ms after a sync and with the host ahead, and the GPU's wait between."""
    inp = kg.make_inputs(*kg.SHAPES[shape])
    main_grad = torch.zeros(inp["weight"].shape, dtype=torch.float32, device="cuda")
    table = Rounds(spin_then_time)
    pairs = []
    for method, (mode, call) in paths(inp, main_grad).items():
        call()  # compile and warm up
        synced = table.add({"method": method, "mode": mode, "timing": "after sync"}, call)
        ahead = table.add(
            {"method": method, "mode": mode, "timing": "host ahead"},
            Ahead(call, int(ahead_ms * cycles)),
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
        "--ahead-ms", type=float, default=25.0, help="GPU spin before each 'host ahead' call"
    )
    args = parser.parse_args()
    cycles = cycles_per_ms()
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(env | {"lce": kg.lce.__file__}, flush=True)  # which tree's lce an A/B imported
    report: dict = {"env": env}
    report |= {"ahead_ms": args.ahead_ms, "rounds": ROUNDS, "rows": []}
    for shape in args.shapes.split(","):
        report["rows"] += bench_shape(shape, args.ahead_ms, cycles)
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
