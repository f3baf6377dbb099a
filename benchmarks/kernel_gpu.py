"""Verify and benchmark the Triton backend on one CUDA GPU, in one call (issues 3, 24 and 33).

Run from the repo root (each peer is used when its package imports; wheels travel in .whl/):
    PYTHONPATH=. python benchmarks/kernel_gpu.py --no-sweep --json results.json
Steps: (1) the compiled kernels vs float64 at one large shape; (2) a tile sweep of both kernels at
llama3-8k, the fastest tiles become the config of (3) (``--no-sweep`` keeps the configured ones);
(3) the stages' breakdown (``--breakdown-shapes``); (4) per shape: the GEMM floors (1, 3 and 4
bf16 GEMMs, each in one call), stock PyTorch, lce triton (default, fast, main_grad), the cuBLAS
GEMMs of the main_grad path alone, lce and stock with a softcap and a z-loss (`option_rows`, at
`OPTION_SHAPES`), and the peers (`PEERS`: Liger's Triton FLCE and Hopper CuTe kernels, QuACK,
Apple CCE and its torch_compile path; the scalar-loss peers also with their grad_weight added to
an fp32 main_grad): peak memory above the inputs (GiB) and normwise grad errors vs an fp32
materialized reference, row by row; then the times of every row in interleaved rounds
(`rounds.Rounds`: median ms, each round's in ``round_ms``; ``--timing``: each call behind a GEMM
load, or right after a sync); then each issue's verdicts (`kernel_targets`). The stage tests
run apart: pytest tests/lce/test_triton_stages.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import itertools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import lce
from lce.backends.base import BackwardRows, ShardStats, TokenUpstream, Wanted
from lce.backends.gemm import addmm_, mm_into
from lce.backends.triton import TileShape, TritonStages
from lce.backends.triton import config as triton_config
from lce.backends.triton.backward_kernel import dlogits_chunk
from lce.backends.triton.forward_kernel import forward_partials, merge_partials
from lce.backends.triton.stages import chunk_width
from lce.backends.triton.target_kernel import target_logits_into
from lce.options import LogitOptions
from lce.tp import VocabShard, merge_stats
from verify.numerics.reference import IGNORE_INDEX

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "lce"))
import kernel_targets  # this script's folder is on sys.path
import option_rows
from rounds import TIMERS, Rounds, Timer, event_ms
from test_triton_stages import reference_grads, reference_rows, reference_stats

PLAIN = LogitOptions()  # temperature 1, no other option: the plain LM head

SHAPES = {
    "llama3-8k": (8192, 4096, 128256),
    "qwen2.5-16k": (16384, 3584, 152064),
    "gemma2-8k": (8192, 2304, 256000),
}
TARGET_SHAPE = "llama3-8k"  # where issue 3 sets its targets
OPTION_SHAPES = ("gemma2-8k",)  # issue 31: the softcap and z-loss rows at Gemma 2's shape
GIB = float(1 << 30)


def time_ms(fn: Callable[[], object], warmup: int = 2, iters: int = 5) -> float:
    """Median of ``iters`` CUDA-event timings after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_ms(fn) for _ in range(iters))


def peak_gib(fn: Callable[[], object]) -> tuple[float, object]:
    """Peak allocated memory above what existed before the call, and the call's result."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GIB, out


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------- (1) correctness, compiled


def check_large(num_tokens=4096, hidden_size=4096, vocab=32257, temperature=0.8) -> dict:
    """Stage outputs vs float64 at a shape with V off the tile; grads vs 2x the bf16 baseline."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.05).bfloat16()
    targets = torch.randint(-1, vocab, (num_tokens,), device="cuda", generator=gen)
    upstream_ = torch.randn(2, num_tokens, device="cuda", generator=gen) * (targets != -1)
    upstream = (upstream_[0], upstream_[1])
    stages = TritonStages()
    logit = LogitOptions(temperature=temperature)
    stats = stages.forward_stats(hidden, weight, None, targets, 0, logit)
    ref_stats = reference_stats(hidden, weight, targets, 0, temperature)
    max_z = stats.max.double() / temperature  # max and target_logit come in raw dot units
    lse = max_z + stats.sumexp.double().log()
    expected = max_z + stats.sumexp_z.double() / stats.sumexp.double()
    result = {
        "shape": [num_tokens, hidden_size, vocab],
        "lse_max_abs_err": (lse - ref_stats.lse).abs().max().item(),
        "expected_max_abs_err": (expected - ref_stats.expected).abs().max().item(),
        "target_max_abs_err": (stats.target_logit.double() / temperature - ref_stats.target)
        .abs()
        .max()
        .item(),
    }
    rows = reference_rows(hidden, weight, targets, 0, temperature, upstream)
    grads = stages.backward_grads(hidden, weight, None, targets, 0, logit, rows, Wanted(True, True))
    ref = reference_grads(hidden, weight, targets, 0, temperature, upstream)
    base = reference_grads(hidden, weight, targets, 0, temperature, upstream, torch.bfloat16)
    ok = max(result["lse_max_abs_err"], result["expected_max_abs_err"]) < 1e-3
    for name, got, r, b in zip(("grad_hidden", "grad_weight"), grads[:2], ref, base, strict=True):
        result[f"{name}_rel_err"] = rel(got.double(), r)
        # The baseline rounded like the result (grad_weight comes back in weight's dtype).
        result[f"{name}_baseline_rel_err"] = rel(b.to(got.dtype).double(), r)
        ok &= result[f"{name}_rel_err"] <= 2 * result[f"{name}_baseline_rel_err"] + 1e-5
    result["pass"] = bool(ok)
    return result


# ---------------------------------------------------------------- (2) tile sweep


def _tile(block_t, block_v, block_h, stages, warps=8, group=16, regs=None) -> TileShape:
    return TileShape(block_t, block_v, block_h, group, warps, stages, max_registers=regs)


# (kernel, tile, forward vocab tiles per program, TMA loads)
VARIANTS = [
    ("forward", _tile(128, 256, 64, 3), 1, True),
    ("forward", _tile(128, 256, 64, 3), 1, False),
    ("forward", _tile(128, 256, 64, 3), 2, True),
    ("forward", _tile(128, 256, 64, 3), 4, True),
    ("forward", _tile(128, 256, 64, 4), 1, True),
    ("forward", _tile(128, 256, 64, 3, group=8), 1, True),
    ("forward", _tile(256, 128, 64, 3), 1, True),
    ("forward", _tile(128, 128, 64, 4), 1, True),
    ("backward", _tile(128, 128, 64, 4), None, True),
    ("backward", _tile(128, 128, 64, 4), None, False),
    ("backward", _tile(128, 256, 64, 3), None, True),
    ("backward", _tile(128, 256, 64, 4), None, True),
    ("backward", _tile(128, 128, 128, 3), None, True),
    ("backward", _tile(128, 128, 64, 4, group=8), None, True),
    ("backward", _tile(256, 128, 64, 3), None, True),
]


def _sweep_fn(kernel, tile, tpp, tma, data) -> tuple[Callable[[], object], float]:
    """The timed call of one variant and the factor that scales it to the whole vocabulary."""
    hidden, weight, targets, ones, d_logits = data
    if kernel == "forward":
        cfg = dataclasses.replace(
            triton_config.GPU_CONFIG, forward=tile, tiles_per_program=tpp, use_tma=tma
        )
        return lambda: forward_partials(hidden, weight, None, PLAIN, cfg), 1.0
    cfg = dataclasses.replace(triton_config.GPU_CONFIG, backward=tile, use_tma=tma)
    width = d_logits.shape[1]
    rows = BackwardRows(*[ones] * len(dataclasses.fields(BackwardRows)))
    values = ones.to(weight.dtype)

    def one_chunk():
        dlogits_chunk(hidden, weight[:width], None, targets, 0, PLAIN, rows, values, d_logits, cfg)

    return one_chunk, weight.shape[0] / width


def sweep(num_tokens: int, hidden_size: int, vocab: int) -> tuple[list[dict], object]:
    """Time each variant of both kernels; returns rows and the config of the fastest ones."""
    hidden = torch.randn(num_tokens, hidden_size, device="cuda").bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda") * 0.02).bfloat16()
    targets = torch.randint(0, vocab, (num_tokens,), device="cuda")
    cfg = triton_config.GPU_CONFIG
    width = chunk_width(num_tokens, vocab, 2, cfg.chunk_bytes, cfg.backward.block_v)
    d_logits = torch.empty(num_tokens, width, dtype=torch.bfloat16, device="cuda")
    data = (hidden, weight, targets, torch.ones(num_tokens, device="cuda"), d_logits)
    rows = []
    for kernel, tile, tpp, tma in VARIANTS:
        row = {"kernel": kernel, "tile": dataclasses.asdict(tile), "tiles_per_program": tpp}
        row["use_tma"] = tma
        try:
            fn, scale = _sweep_fn(kernel, tile, tpp, tma, data)
            row["ms"] = time_ms(fn, warmup=1, iters=5) * scale
        except Exception as exc:  # a tile that does not fit (shared memory) is noted, skipped
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        print("sweep", row, flush=True)
    timed = [r for r in rows if "ms" in r]
    fwd = min((r for r in timed if r["kernel"] == "forward"), key=lambda r: r["ms"])
    same_loads = [r for r in timed if r["kernel"] == "backward" and r["use_tma"] == fwd["use_tma"]]
    bwd = min(same_loads, key=lambda r: r["ms"])
    chosen = dataclasses.replace(
        triton_config.GPU_CONFIG, forward=TileShape(**fwd["tile"]),
        tiles_per_program=fwd["tiles_per_program"], backward=TileShape(**bwd["tile"]),
        use_tma=fwd["use_tma"],
    )  # fmt: skip
    return rows, chosen


# (aliased_chunk_bytes, tail_chunk_bytes) in MiB that `breakdown` times the backward with, in
# alternating rounds (the card's clocks drift within a run).
CHUNK_PLANS = ((128, 16), (1024, 16), (512, 64))
CHUNK_PLAN_ROUNDS = 2


def breakdown(num_tokens: int, hidden_size: int, vocab: int) -> dict:
    """Where lce's time goes at one shape: the stages alone vs through the autograd function."""
    inp = make_inputs(num_tokens, hidden_size, vocab)
    hidden, weight, targets = inp["hidden"], inp["weight"], inp["targets"].clamp(min=-1)
    stages = TritonStages()
    stats = stages.forward_stats(hidden, weight, None, targets, 0, PLAIN)
    merged = merge_stats(stats, targets >= 0, VocabShard(None, 0, weight.shape[0]), PLAIN)
    g_lp = inp["upstream"]
    zero = torch.zeros_like(g_lp)
    rows = merged.backward_rows(TokenUpstream(g_lp, zero, zero, zero))
    args = (hidden, weight, None, targets, 0, PLAIN, rows)
    config = triton_config.GPU_CONFIG
    partials, split_cols = forward_partials(hidden, weight, None, PLAIN, config)
    stats_out = torch.empty(len(dataclasses.fields(ShardStats)), hidden.shape[0], device="cuda")
    out = {
        "forward_stats_ms": time_ms(
            lambda: stages.forward_stats(hidden, weight, None, targets, 0, PLAIN)
        ),
        "merge_partials_ms": time_ms(
            lambda: merge_partials(partials, PLAIN, weight.shape[0], split_cols, stats_out)
        ),
        "target_logits_ms": time_ms(
            lambda: target_logits_into(
                hidden, weight, None, targets, 0, PLAIN, config, stats_out[3]
            )
        ),
        "backward_grads_ms": time_ms(lambda: stages.backward_grads(*args, Wanted(True, True))),
        "backward_grad_weight_only_ms": time_ms(
            lambda: stages.backward_grads(*args, Wanted(False, True))
        ),
        "backward_grad_hidden_only_ms": time_ms(
            lambda: stages.backward_grads(*args, Wanted(True, False))
        ),
    }
    # d_logits chunks inside grad_weight's free rows (MiB; wider costs no peak) and the tail
    # buffer's (the peak's only part above grad_weight and grad_hidden's sums): fewer chunks,
    # fewer passes over grad_hidden's fp32 sums.
    for round_, (aliased, tail) in itertools.product(range(CHUNK_PLAN_ROUNDS), CHUNK_PLANS):
        cfg = dataclasses.replace(
            triton_config.GPU_CONFIG, aliased_chunk_bytes=aliased << 20, tail_chunk_bytes=tail << 20
        )
        grads = functools.partial(TritonStages(cfg).backward_grads, *args, Wanted(True, True))
        key = f"backward_grads_aliased{aliased}_tail{tail}MiB"
        out[f"{key}_round{round_}_ms"] = time_ms(grads)
        out[f"{key}_peak_gib"] = peak_gib(grads)[0]
    print("breakdown", out, flush=True)
    return out


# ---------------------------------------------------------------- (3) benchmark


def make_inputs(num_tokens: int, hidden_size: int, vocab: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.02).bfloat16()
    targets = torch.randint(0, vocab, (num_tokens,), device="cuda", generator=gen)
    targets[::17] = IGNORE_INDEX
    upstream = torch.randn(num_tokens, device="cuda", generator=gen)
    return {"hidden": hidden, "weight": weight, "targets": targets, "upstream": upstream}


def fp32_reference(inp: dict) -> dict:
    """fp32 materialized grads (IEEE matmuls) for the mean loss and the per-token mode."""
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {}
    for mode in ("mean", "token"):
        hidden = inp["hidden"].float().requires_grad_()
        weight = inp["weight"].float().requires_grad_()
        logits = hidden @ weight.T
        if mode == "mean":
            loss = F.cross_entropy(logits, inp["targets"], ignore_index=IGNORE_INDEX)
            out["loss"] = loss.item()
        else:
            per_token = F.cross_entropy(
                logits, inp["targets"], ignore_index=IGNORE_INDEX, reduction="none"
            )
            loss = (-per_token * inp["upstream"]).sum()
        out[mode] = torch.autograd.grad(loss, (hidden, weight))
        del logits, loss
    return out


def grads_of(loss_fn: Callable, inp: dict, mode: str) -> Callable[[], tuple]:
    """A closure running forward+backward: mean loss, or per-token logprob x random upstream."""

    def run():
        hidden = inp["hidden"].detach().requires_grad_()
        weight = inp["weight"].detach().requires_grad_()
        out = loss_fn(hidden, weight, inp["targets"], mode)
        loss = out if mode == "mean" else (out * inp["upstream"]).sum()
        return loss.detach(), *torch.autograd.grad(loss, (hidden, weight))

    return run


def stock_loss(hidden, weight, targets, mode):
    logits = (hidden @ weight.T).float()
    if mode == "mean":
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
    return -F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")


def stock_forward(inp):
    logits = (inp["hidden"] @ inp["weight"].T).float()
    log_probs = logits.log_softmax(dim=-1)
    picked = log_probs.gather(1, inp["targets"].clamp(min=0)[:, None])
    return picked, -(log_probs.exp() * log_probs).sum(dim=-1)


def lce_loss(hidden, weight, targets, mode):
    if mode == "mean":
        return lce.linear_cross_entropy(hidden, weight, targets, backend="triton")
    return lce.token_logprobs(hidden, weight, targets, backend="triton").logprobs


def lce_kept_loss(hidden, weight, targets, mode):
    """lce with a budget of exactly its ``[T, V]`` bf16 logits: kept for the backward."""
    keep = targets.numel() * weight.shape[0] * weight.element_size()
    if mode == "mean":
        return lce.linear_cross_entropy(
            hidden, weight, targets, backend="triton", keep_logits_bytes=keep
        )
    out = lce.token_logprobs(hidden, weight, targets, backend="triton", keep_logits_bytes=keep)
    return out.logprobs


def lce_fast_loss(hidden, weight, targets, mode):
    return lce.linear_cross_entropy(hidden, weight, targets, backend="triton", fast=True)


def main_grad_run(inp: dict, main_grad: torch.Tensor) -> Callable[[], tuple]:
    """The mean loss with grad_weight added to ``main_grad`` (allocated by the caller, so the
    peak above the inputs does not count it); returns its gradients as `grads_of` does."""

    def run():
        hidden = inp["hidden"].detach().requires_grad_()
        weight = inp["weight"].detach().requires_grad_()
        loss = lce.linear_cross_entropy(
            hidden, weight, inp["targets"], backend="triton", grad_weight_into=main_grad
        )
        (grad_hidden,) = torch.autograd.grad(loss, (hidden,))
        return loss.detach(), grad_hidden, main_grad

    return run


def peer_losses(skip: frozenset[str] = frozenset()) -> tuple[dict[str, Callable], dict[str, str]]:
    """The peers whose packages import (the wheels travel in .whl/), but those in ``skip``; and
    why each missing one is missing (its import error, or the skip)."""
    peers, unavailable = {}, {}
    for name, make in PEERS.items():
        if name in skip:
            unavailable[name] = "skipped (--skip-peers)"
            continue
        try:
            peers[name] = make()
        except Exception as exc:
            first_sentence = str(exc).split(". ")[0]  # an install hint follows in some errors
            unavailable[name] = f"{type(exc).__name__}: {first_sentence}"
    for name, why in unavailable.items():
        print(f"{name} unavailable: {why}", flush=True)
    return peers, unavailable


def _negated_unless_mean(loss_fn: Callable, **kwargs) -> Callable:
    """A peer's loss with ``reduction`` from the mode; per-token losses negated to log-probs."""

    def loss(hidden, weight, targets, mode):
        reduction = "mean" if mode == "mean" else "none"
        out = loss_fn(hidden, weight, targets, reduction=reduction, **kwargs)
        return out if mode == "mean" else -out

    return loss


def liger_flce() -> Callable:
    """Liger 0.8.5's Triton fused linear cross-entropy."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return _negated_unless_mean(liger_fused_linear_cross_entropy)


def cce_loss() -> Callable:
    """Apple CCE 25.1.1, its default (Triton) implementation."""
    from cut_cross_entropy import linear_cross_entropy

    return _negated_unless_mean(linear_cross_entropy)


def cce_compiled_loss() -> Callable:
    """Apple CCE 25.1.1's torch_compile implementation (whole logits, compiled softmax)."""
    from cut_cross_entropy import linear_cross_entropy

    return _negated_unless_mean(linear_cross_entropy, impl="torch_compile")


def liger_cute_loss() -> Callable:
    """Liger 0.8.5's Hopper CuTe DSL per-token op (`fused_linear_scaled_cross_entropy`: NLL;
    needs nvidia-cutlass-dsl), imported here so a missing package is reported before any
    timing. The mean loss is its per-token NLL averaged."""
    from liger_kernel.ops.cutedsl.ops import fused_scaled_cross_entropy_sm90  # noqa: F401
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import (
        LigerFusedLinearScaledCrossEntropyFunction as cute,
    )

    def loss(hidden, weight, targets, mode):
        nll = cute.apply(hidden, weight, targets, 1.0, IGNORE_INDEX)
        if mode != "mean":
            return -nll
        return nll.sum() / (targets != IGNORE_INDEX).sum()

    return loss


def liger_cute_flce_loss() -> Callable:
    """Liger 0.8.5's Hopper CuTe DSL fused linear cross-entropy (mean or sum only: gradients in
    the forward, whole bf16 logits; M a multiple of 128, V of 256)."""
    from liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90 import (
        liger_fused_linear_cross_entropy_sm90 as flce,
    )

    def loss(hidden, weight, targets, mode):
        assert mode == "mean", "mean-loss only"
        return flce(hidden, weight, targets, IGNORE_INDEX, "mean")

    return loss


QUACK_CHUNK = 4096  # QuACK's default chunk of tokens


def quack_loss() -> Callable:
    """QuACK 0.6.5's `chunked_linear_cross_entropy` (mean or sum only; the scaled-exp pipeline
    where eligible). Its default 4096-token chunks, but twice that where H is 4096: a chunk of
    H rows makes its dx GEMM's epilogue raise "m == n makes row/col inference ambiguous"."""
    from quack.linear_cross_entropy import chunked_linear_cross_entropy

    def loss(hidden, weight, targets, mode):
        assert mode == "mean", "mean-loss only"
        chunk = QUACK_CHUNK * (2 if hidden.shape[1] == QUACK_CHUNK else 1)
        return chunked_linear_cross_entropy(
            hidden, weight, targets, chunk_size=chunk, ignore_index=IGNORE_INDEX
        )

    return loss


PEERS: dict[str, Callable[[], Callable]] = {
    "Liger FLCE": liger_flce,
    kernel_targets.LIGER_CUTE: liger_cute_loss,
    kernel_targets.LIGER_CUTE_FLCE: liger_cute_flce_loss,
    kernel_targets.QUACK: quack_loss,
    "Apple CCE": cce_loss,
    kernel_targets.CCE_COMPILE: cce_compiled_loss,
}


ROUNDS = 15  # one timed call of each row per round (`rounds.Rounds`); with 7, one call timed
# as two rows came out 2% apart (86.3 and 88.0 ms)


def measure(
    table: Rounds,
    name: str,
    fn: Callable,
    ref: dict | None,
    mode: str | None,
    reset: Callable[[], object] | None = None,
) -> dict:
    """Peak and errors of ``fn`` after one warm-up call (``reset`` runs before the call whose
    errors count); the row joins ``table``, whose rounds time it with the others."""
    row = {"method": name, "mode": mode or "fwd"}
    try:
        fn()
        if reset is not None:
            reset()
        row["peak_gib"], out = peak_gib(fn)
        if ref is not None:
            loss, grad_hidden, grad_weight = out
            row["gx_rel"] = rel(grad_hidden, ref[mode][0])
            row["gw_rel"] = rel(grad_weight, ref[mode][1])
            if mode == "mean":
                row["loss_abs_err"] = abs(loss.item() - ref["loss"])
        del out
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        traceback.print_exc()
    print(name, row, flush=True)
    return table.add(row, fn)


def bench_shape(shape: str, peers: dict[str, Callable], timer: Timer) -> dict:
    """Every row of one shape: peak and errors row by row, then the times in `ROUNDS`
    interleaved rounds over all of them (`rounds.Rounds`, each call timed by ``timer``)."""
    num_tokens, hidden_size, vocab = SHAPES[shape]
    inp = make_inputs(num_tokens, hidden_size, vocab)
    ref = fp32_reference(inp)
    gc.collect()
    torch.cuda.empty_cache()
    table = Rounds(timer)
    for gemms in MODE_GEMMS.values():
        measure(table, kernel_targets.gemms_method(gemms), gemm_call(inp, gemms), None, None)
    forwards = {
        "stock PyTorch": lambda: stock_forward(inp),
        "lce triton": functools.partial(lce_loss, **_args(inp), mode="token"),
    }
    forwards |= {name: functools.partial(f, **_args(inp), mode="mean") for name, f in peers.items()}
    for name, forward in forwards.items():
        measure(table, name, torch.no_grad()(forward), None, None)
    methods = {"stock PyTorch": stock_loss, "lce triton": lce_loss, **peers}
    for mode in ("mean", "token"):
        for name, loss_fn in methods.items():
            if mode == "mean" or name not in kernel_targets.MEAN_ONLY:
                measure(table, name, grads_of(loss_fn, inp, mode), ref, mode)
    main_grad = torch.zeros(inp["weight"].shape, dtype=torch.float32, device="cuda")
    lce_scalar_rows(table, inp, ref, main_grad)
    peers_into_main_grad(table, inp, ref, main_grad, peers)
    lce_step_rows(table, inp, ref)
    if shape in OPTION_SHAPES:
        lce_option_rows(table, inp)
    grads_gib = (num_tokens + vocab) * hidden_size * 2 / GIB
    rows = table.time(ROUNDS)
    return {"shape": shape, "T_H_V": SHAPES[shape], "grads_gib": grads_gib, "rows": rows}


# Each mode's floor, in GEMMs (each floor a row of its own, timed as one call): the forward's
# one, the scalar loss's 3, the per-token path's 4.
MODE_GEMMS = {"fwd": 1, "mean": 3, "token": 4}


def gemm_call(inp: dict, gemms: int) -> Callable[[], torch.Tensor]:
    """``gemms`` times ``hidden @ weight.T`` in one call (each product freed by the next)."""

    def run() -> torch.Tensor:
        for _ in range(gemms):
            logits = inp["hidden"] @ inp["weight"].T
        return logits

    return run


@contextlib.contextmanager
def triton_config_changed(**changes) -> Iterator[None]:
    """`GPU_CONFIG` with ``changes`` inside (what the stages read at each call)."""
    saved = triton_config.GPU_CONFIG
    triton_config.GPU_CONFIG = dataclasses.replace(saved, **changes)
    try:
        yield
    finally:
        triton_config.GPU_CONFIG = saved


def lce_scalar_rows(table: Rounds, inp: dict, ref: dict, main_grad: torch.Tensor) -> None:
    """lce's other rows: the mean loss with the fp32 grad_weight buffer, fast, into
    ``main_grad``; the cuBLAS GEMMs of the main_grad path alone, chunked as it runs them (no row
    kernels); kept logits, per-token and mean."""
    fp32 = triton_config_changed(grad_weight_fp32=True)(grads_of(lce_loss, inp, "mean"))
    measure(table, "lce triton, fp32 grad_weight", fp32, ref, "mean")
    measure(table, kernel_targets.LCE_FAST, grads_of(lce_fast_loss, inp, "mean"), ref, "mean")
    run = main_grad_run(inp, main_grad)
    measure(table, kernel_targets.LCE_MAIN_GRAD, run, ref, "mean", reset=main_grad.zero_)
    measure(table, PATH_GEMMS, lambda: path_gemms(inp, main_grad), None, "mean")
    for mode in ("token", "mean"):
        measure(table, kernel_targets.LCE_KEPT, grads_of(lce_kept_loss, inp, mode), ref, mode)


def peers_into_main_grad(
    table: Rounds, inp: dict, ref: dict, main_grad: torch.Tensor, peers: dict[str, Callable]
) -> None:
    """Each scalar-loss peer's mean loss with its bf16 grad_weight then added to the fp32
    ``main_grad``, as Megatron's gradient hook does for a layer that does not add it itself:
    what ``grad_weight_into`` delivers, for a like-for-like time."""
    for name in kernel_targets.SCALAR_PEERS:
        if name not in peers:
            continue
        step = grads_of(peers[name], inp, "mean")

        def into(step=step) -> tuple:
            loss, grad_hidden, grad_weight = step()
            return loss, grad_hidden, main_grad.add_(grad_weight)

        row_name = kernel_targets.into_main_grad(name)
        measure(table, row_name, into, ref, "mean", reset=main_grad.zero_)


LCE_COMPILED = "lce triton, torch.compile"
LCE_GRAPHED = "lce triton, CUDA graph replay"


def lce_step_rows(table: Rounds, inp: dict, ref: dict) -> None:
    """lce's forward+backward under ``torch.compile(fullgraph=True)`` (mean loss and per-token),
    and the mean loss's captured in a CUDA graph and replayed, next to the eager rows of the
    same run (same inputs and reference). ``first_call_s``: the compiled step's first call
    (Dynamo, AOTAutograd and Inductor around lce's op; Triton's own compile is cached by then)."""
    compiled = torch.compile(lce_loss, fullgraph=True)
    for mode in ("mean", "token"):
        began = time.perf_counter()
        step = grads_of(compiled, inp, mode)
        with contextlib.suppress(Exception):  # measure() records the error on the row
            step()
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - began
        measure(table, LCE_COMPILED, step, ref, mode)["first_call_s"] = first_call_s
    try:
        replay = graphed_step(inp)
    except Exception as exc:  # a failed capture is a row of the table, not the run's end
        traceback.print_exc()
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
        table.add({"method": LCE_GRAPHED, "mode": "mean", "error": error}, None)
        return
    measure(table, LCE_GRAPHED, replay, ref, "mean")


def graphed_step(inp: dict) -> Callable[[], tuple]:
    """The mean loss's forward+backward captured once (after two warm-up runs on a side
    stream); each call replays the graph on the captured inputs and returns its outputs."""
    hidden = inp["hidden"].detach().clone().requires_grad_()
    weight = inp["weight"].detach().clone().requires_grad_()

    def step() -> tuple:
        loss = lce_loss(hidden, weight, inp["targets"], "mean")
        return loss.detach(), *torch.autograd.grad(loss, (hidden, weight))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()

    def replay() -> tuple:
        graph.replay()
        return outputs

    return replay


def lce_option_rows(table: Rounds, inp: dict) -> None:
    """Per logit option (`option_rows.OPTIONS`): the stock path and lce with it, against an fp32
    materialized reference with the same option (IEEE fp32 GEMMs)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    as_fp32 = {**inp, "hidden": inp["hidden"].float(), "weight": inp["weight"].float()}
    for name, (options, modes) in option_rows.OPTIONS.items():
        stock = option_rows.stock_loss_with(options)
        methods = {"stock PyTorch": stock, "lce triton": option_rows.lce_loss_with(options)}
        for mode in modes:
            loss, grad_hidden, grad_weight = grads_of(stock, as_fp32, mode)()
            ref = {mode: (grad_hidden, grad_weight), "loss": loss.item()}
            del loss, grad_hidden, grad_weight
            for method, loss_fn in methods.items():
                measure(table, f"{method}, {name}", grads_of(loss_fn, inp, mode), ref, mode)
            del ref
            gc.collect()
            torch.cuda.empty_cache()


PATH_GEMMS = "cuBLAS GEMMs of the main_grad path"


def path_gemms(inp: dict, main_grad: torch.Tensor) -> None:
    """The main_grad path's three cuBLAS GEMMs per token chunk, nothing else: logits in weight's
    dtype, grad_hidden rows in fp32, grad_weight added into ``main_grad`` in fp32."""
    hidden, weight = inp["hidden"], inp["weight"]
    step = TritonStages().loss_chunk_rows(hidden.shape[0], weight.shape[0], hidden.shape[1], 2)
    logits = weight.new_empty(min(step, hidden.shape[0]), weight.shape[0])
    grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], step):
        rows = slice(start, start + step)
        chunk = logits[: hidden[rows].shape[0]]
        mm_into(hidden[rows], weight.T, out=chunk)
        mm_into(chunk, weight, out=grad_hidden[rows])
        addmm_(main_grad, chunk.T, hidden[rows])


def _args(inp: dict) -> dict:
    return {"hidden": inp["hidden"], "weight": inp["weight"], "targets": inp["targets"]}


def _cell(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def print_table(result: dict) -> None:
    """Markdown table of one shape; ratios against its GEMM floors (`kernel_targets.gemm_ms`:
    one GEMM for the forward, 3 for the mean loss, 4 per token)."""
    rows = result["rows"]
    floors = {mode: kernel_targets.gemm_ms(rows, n) for mode, n in MODE_GEMMS.items()}
    print(f"\n## {result['shape']} {result['T_H_V']}  (grads floor {result['grads_gib']:.2f} GiB)")
    print("| method | mode | ms | x floor | peak GiB | x grads | gx rel | gw rel |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['method']} | {r['mode']} | error: {r['error'][:80]} | | | | | |")
            continue
        grads = r["mode"] != "fwd"
        cells = [
            _cell(r["ms"], ".1f"),
            _cell(r["ms"] / floors[r["mode"]], ".2f"),
            _cell(r["peak_gib"], ".2f"),
            _cell(r["peak_gib"] / result["grads_gib"] if grads else None, ".2f"),
            _cell(r.get("gx_rel"), ".1e"),
            _cell(r.get("gw_rel"), ".1e"),
        ]
        print(f"| {r['method']} | {r['mode']} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write all numbers")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated SHAPES keys")
    parser.add_argument("--no-sweep", action="store_true", help="keep the configured tiles")
    parser.add_argument(
        "--breakdown-shapes", default=TARGET_SHAPE, help="SHAPES keys of the stage breakdown"
    )
    parser.add_argument("--skip-peers", default="", help="comma-separated peer names not to run")
    parser.add_argument(
        "--timing", choices=tuple(TIMERS), default="loaded",
        help="each timed call queued behind a GEMM load (loaded) or right after a sync (synced)",
    )  # fmt: skip
    args = parser.parse_args()
    env = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "timing": args.timing,
    }
    print(env, flush=True)
    report: dict = {"env": env}
    try:
        report["large_check"] = check_large()
    except Exception as exc:  # recorded; the sweep and table still run
        traceback.print_exc()
        report["large_check"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print("large check", report["large_check"], flush=True)
    if not args.no_sweep:
        report["sweep"], chosen = sweep(*SHAPES["llama3-8k"])
        triton_config.GPU_CONFIG = chosen
    for shape in filter(None, args.breakdown_shapes.split(",")):
        report[f"breakdown_{shape}"] = breakdown(*SHAPES[shape])
    report["config"] = dataclasses.asdict(triton_config.GPU_CONFIG)
    print("config", report["config"], flush=True)
    skip = frozenset(filter(None, args.skip_peers.split(",")))
    peers, report["peers_unavailable"] = peer_losses(skip)
    report["shapes"] = []
    for shape in args.shapes.split(","):
        report["shapes"].append(bench_shape(shape, peers, TIMERS[args.timing]()))
        gc.collect()
        torch.cuda.empty_cache()
        Path(args.json).write_text(json.dumps(report, indent=1))
    for result in report["shapes"]:
        print_table(result)
    for result in report["shapes"]:
        if result["shape"] == TARGET_SHAPE:
            print_targets(result, report)
    for result in report["shapes"]:
        print_issue24_targets(result, report, report["peers_unavailable"])
    for result in report["shapes"]:
        print_issue33_targets(result, report, report["peers_unavailable"])
        if result["shape"] in OPTION_SHAPES:
            lines = report[f"option_verdicts_{result['shape']}"] = option_rows.verdicts(
                result["rows"]
            )
            print(f"\n## logit options at {result['shape']}\n" + "\n".join(lines))
    Path(args.json).write_text(json.dumps(report, indent=1))


def print_targets(result: dict, report: dict) -> None:
    """Issue 3's verdicts at one shape, printed and stored in ``report`` (a missing row skips)."""
    try:
        verdicts = kernel_targets.judge(result["rows"], result["grads_gib"])
    except KeyError as exc:
        print(f"\nissue-3 targets not judged: {exc}")
        return
    report[f"targets_{result['shape']}"] = [v.row() for v in verdicts]
    print(f"\n## issue-3 targets at {result['shape']}\n{kernel_targets.format_verdicts(verdicts)}")


def print_issue24_targets(result: dict, report: dict, unavailable: dict[str, str]) -> None:
    """Issue 24's verdicts at one shape, printed and stored in ``report``."""
    verdicts, skipped = kernel_targets.judge_issue24(
        result["rows"], result["grads_gib"], unavailable
    )
    report[f"issue24_targets_{result['shape']}"] = {
        "verdicts": [v.row() for v in verdicts],
        "not_judged": skipped,
    }
    table = kernel_targets.format_verdicts(verdicts, skipped)
    print(f"\n## issue-24 targets at {result['shape']}\n{table}")


def print_issue33_targets(result: dict, report: dict, unavailable: dict[str, str]) -> None:
    """Issue 33's verdicts and the users' comparisons at one shape, printed and stored in
    ``report``."""
    for key, (verdicts, skipped) in kernel_targets.issue33_sections(result, unavailable).items():
        report[f"{key}_{result['shape']}"] = {
            "verdicts": [v.row() for v in verdicts],
            "not_judged": skipped,
        }
        table = kernel_targets.format_verdicts(verdicts, skipped)
        print(f"\n## {kernel_targets.SECTION_TITLES[key]} at {result['shape']}\n{table}")


if __name__ == "__main__":
    main()
