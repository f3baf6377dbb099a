"""Where the 3-GEMM loss (``grad_weight_into=``, the main_grad path) spends its time, on one GPU.

Run from the repo root:
    PYTHONPATH=. python benchmarks/loss_profile.py --json OUT.json
Per shape: the CUDA kernels of one forward+backward under torch.profiler (total ms per kernel
name), then the whole call at several ``loss_chunk_bytes`` budgets (time and peak: the chunk
trades memory for fewer grad_weight accumulations), then one chunk's stages one at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

import torch
from kernel_gpu import GIB, SHAPES, main_grad_run, make_inputs, peak_gib, time_ms  # same folder
from torch.profiler import ProfilerActivity, profile

from lce.backends.base import BackwardRows, ShardStats
from lce.backends.gemm import addmm_, mm_into
from lce.backends.triton import TritonStages
from lce.backends.triton import config as triton_config
from lce.backends.triton.forward_kernel import forward_partials
from lce.backends.triton.loss_kernels import row_dlogits, row_stats_into
from lce.options import LogitOptions

PLAIN = LogitOptions()  # temperature 1, no other option: the plain LM head

CHUNK_BUDGETS_GIB = (1.25, 1.5)


def kernel_table(run, iters: int = 3) -> dict:
    """Device ms per kernel name over ``iters`` calls (divided back to one call), and where the
    device idles: each event-timed call against its kernels' span and busy time (and the SM
    clock after it, where NVML answers), the largest gaps between kernels with their
    neighbours."""
    run()
    torch.cuda.synchronize()
    walls, clocks = [], []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            walls.append(start.elapsed_time(end))
            clocks.append(sm_clock_mhz())
    kernels = sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA"),
        key=lambda e: e.time_range.start,
    )
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in kernels:
        entry = totals[event.name[:90]]
        entry[0] += event.device_time / 1000.0
        entry[1] += 1
    rows = [
        {"kernel": name, "ms": ms / iters, "calls": calls // iters}
        for name, (ms, calls) in totals.items()
    ]
    gaps = [
        {
            "us": after.time_range.start - before.time_range.end,
            "after": before.name[:60],
            "before": after.name[:60],
        }
        for before, after in pairwise(kernels)
    ]
    per_call = len(kernels) // iters
    calls = [kernels[i * per_call : (i + 1) * per_call] for i in range(iters)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as host:
        run()
        torch.cuda.synchronize()
    host_ops = sorted(host.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return {
        "host_ops": [  # host time per op (syncs wait for the device there)
            {"op": e.key[:60], "calls": e.count, "self_ms": e.self_cpu_time_total / 1000.0}
            for e in host_ops
        ],
        "kernels": sorted(rows, key=lambda r: -r["ms"]),
        "wall_ms": walls,
        "span_ms": [(c[-1].time_range.end - c[0].time_range.start) / 1000.0 for c in calls],
        "busy_ms": [sum(e.device_time for e in c) / 1000.0 for c in calls],
        "sm_clock_mhz": clocks,
        "largest_gaps": sorted(gaps, key=lambda g: -g["us"])[: 8 + iters],
    }


def sm_clock_mhz() -> int | None:
    """The SM clock now (NVML through torch), None where NVML is missing."""
    try:
        return torch.cuda.clock_rate()
    except Exception:  # pynvml absent or no permission: the profile runs without it
        return None


def with_chunk_budget(gib: float) -> triton_config.TritonConfig:
    """The GPU config with logits chunks of at most ``gib`` (no allowance from the gradients)."""
    config = triton_config.GPU_CONFIG
    return dataclasses.replace(config, loss_chunk_bytes=int(gib * GIB), loss_peak_grads=0.0)


def chunk_budgets(inp: dict, main_grad: torch.Tensor) -> list[dict]:
    """The main_grad call's time and peak (main_grad not counted) per chunk budget."""
    rows = []
    saved = triton_config.GPU_CONFIG
    try:
        for gib in CHUNK_BUDGETS_GIB:
            triton_config.GPU_CONFIG = with_chunk_budget(gib)
            run = main_grad_run(inp, main_grad)
            (num_tokens, hidden_size), vocab = inp["hidden"].shape, inp["weight"].shape[0]
            chunk = TritonStages().loss_chunk_rows(num_tokens, vocab, hidden_size, 2)
            row = {"budget_gib": gib, "chunk_rows": chunk, "ms": time_ms(run)}
            row["peak_gib"] = peak_gib(run)[0]
            rows.append(row)
            print("chunk budget", row, flush=True)
    finally:
        triton_config.GPU_CONFIG = saved
    return rows


def stage_times(inp: dict, main_grad: torch.Tensor) -> dict:
    """One default-size chunk's stages alone, and alternatives to them (ms)."""
    hidden, weight, targets = inp["hidden"], inp["weight"], inp["targets"].clamp(min=-1)
    num_tokens, hidden_size = hidden.shape
    rows = TritonStages().loss_chunk_rows(num_tokens, weight.shape[0], hidden_size, 2)
    h, t = hidden[:rows], targets[:rows]
    logits = torch.empty(rows, weight.shape[0], dtype=weight.dtype, device="cuda")
    stats = torch.empty(len(dataclasses.fields(ShardStats)), rows, device="cuda")
    ones = torch.ones(rows, device="cuda")
    zeros = torch.zeros(rows, device="cuda")
    # max, log_sumexp, centred_mean, softmax_coef, grad_entropy, target_grad, uniform
    backward_rows = BackwardRows(stats[0], ones, zeros, ones * 1e-4, zeros, ones, zeros)
    grad_hidden = torch.empty(rows, hidden_size, dtype=torch.float32, device="cuda")
    grad_hidden_bf16 = torch.empty(rows, hidden_size, dtype=weight.dtype, device="cuda")
    mm_into(h, weight.T, out=logits)
    out = {"chunk_rows": rows, "chunks": -(-num_tokens // rows)}
    for block_v, warps in ((2048, 8), (4096, 8), (2048, 4), (1024, 4), (4096, 16), (8192, 16)):
        name = f"row_stats_block{block_v}_warps{warps}"
        stats_fn = functools.partial(
            row_stats_into, logits, None, t, 0, PLAIN, stats, block_v, warps
        )
        out[name] = time_ms(stats_fn)
        print("stage", name, out[name], flush=True)
    timed = {
        "logits_gemm": lambda: mm_into(h, weight.T, out=logits),
        "forward_partials_kernel": lambda: forward_partials(
            h, weight, None, PLAIN, triton_config.GPU_CONFIG
        ),
        "row_stats": lambda: row_stats_into(logits, None, t, 0, PLAIN, stats),
        "row_dlogits": lambda: row_dlogits(logits, logits, None, t, 0, PLAIN, backward_rows),
        "copy_logits_once": lambda: logits.clone(),
        "grad_hidden_fp32_out": lambda: mm_into(logits, weight, out=grad_hidden),
        "grad_hidden_bf16_out": lambda: torch.mm(logits, weight, out=grad_hidden_bf16),
        "grad_weight_addmm_fp32": lambda: addmm_(main_grad, logits.T, h),
        "grad_weight_mm_fp32_no_accumulate": lambda: mm_into(logits.T, h, out=main_grad),
        "grad_weight_mm_bf16": lambda: torch.mm(logits.T, h),
    }
    for name, fn in timed.items():
        try:
            out[name] = time_ms(fn)
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print("stage", name, out[name], flush=True)
    return out


def profile_shape(shape: str) -> dict:
    inp = make_inputs(*SHAPES[shape])
    main_grad = torch.zeros(inp["weight"].shape, dtype=torch.float32, device="cuda")
    result = {"gemm_ms": time_ms(lambda: inp["hidden"] @ inp["weight"].T)}
    result.update(kernel_table(main_grad_run(inp, main_grad)))
    print(f"\n## {shape}: one GEMM {result['gemm_ms']:.2f} ms; kernels of one call")
    for row in result["kernels"][:8]:
        print(f"{row['ms']:8.2f} ms  x{row['calls']:<3d} {row['kernel']}")
    for key in ("wall_ms", "span_ms", "busy_ms", "sm_clock_mhz"):
        print(key, [None if v is None else round(v, 2) for v in result[key]])
    for op in result["host_ops"]:
        print(f"host {op['self_ms']:8.2f} ms  x{op['calls']:<4d} {op['op']}")
    for gap in result["largest_gaps"]:
        print(f"gap {gap['us']:8.0f} us after {gap['after']} before {gap['before']}")
    result["chunk_budgets"] = chunk_budgets(inp, main_grad)
    result["stages"] = stage_times(inp, main_grad)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    report = {}
    for shape in args.shapes.split(","):
        report[shape] = profile_shape(shape)
        torch.cuda.empty_cache()
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
