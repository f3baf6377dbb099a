"""Interleaved A/B of lce source trees on one CUDA GPU: the Triton forward and every loss path.

    python benchmarks/tree_ab.py --trees before=OLD_TREE,after=. --reps 3 --json ab.json

Each repetition runs every tree once, in turn, in a subprocess of its own that imports that tree's
`lce` (so one process never mixes two trees' kernels). A run at one shape (llama3-8k by default)
times, after warm-up, with CUDA events and medians: `TritonStages().forward_stats` alternating with
one bf16 GEMM (the floor, which drifts between runs); the default mean loss (4 GEMMs) forward +
backward alternating with the per-token path's (log-probs and entropy under a random upstream);
the 3-GEMM mean loss into an fp32 main_grad (``grad_weight_into``) alternating with the mean loss
over kept logits (a ``keep_logits_bytes`` budget of exactly the logits) and the ``fast`` mean loss
(3 GEMMs, gradients in the inputs' dtype), the paths whose row kernels
(`lce.backends.triton.loss_kernels`) sweep materialized logits; and the default loss's
peak allocated memory above the inputs. The table gives each tree's medians over its runs and
their spread (min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SHAPES = {
    "llama3-8k": (8192, 4096, 128256),
    "qwen2.5-16k": (16384, 3584, 152064),
    "gemma2-8k": (8192, 2304, 256000),
}
FIELDS = (
    "forward_ms", "gemm_ms", "loss_ms", "token_ms", "into_ms", "kept_ms", "fast_ms", "loss_peak_gib"
)  # fmt: skip


def child(shape: str, forward_reps: int, loss_reps: int) -> dict:
    """One tree's numbers at ``shape`` (run with that tree first on sys.path)."""
    import torch
    from rounds import event_ms  # this script's folder, first on sys.path

    import lce
    from lce.backends.triton import TritonStages

    num_tokens, hidden_size, vocab = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.02).bfloat16()
    targets = torch.randint(0, vocab, (num_tokens,), device="cuda", generator=gen)
    targets[::17] = -100
    kernel_targets = targets.clamp(min=-1)  # the stage's ids: -1 for an ignored row

    stages = TritonStages()

    def forward():
        stages.forward_stats(hidden, weight, None, kernel_targets, 0, lce.LogitOptions())

    def gemm():
        hidden @ weight.T

    def loss():
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        out = lce.linear_cross_entropy(h, w, targets, backend="triton")
        return torch.autograd.grad(out, (h, w))

    upstream = torch.randn(2, num_tokens, device="cuda", generator=gen)

    def token():  # RL's path: log-probs and entropy under an arbitrary upstream
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        out = lce.token_logprobs(h, w, targets, backend="triton")
        return torch.autograd.grad([out.logprobs, out.entropy], (h, w), list(upstream))

    main_grad = torch.zeros(vocab, hidden_size, device="cuda")
    keep = num_tokens * vocab * weight.element_size()

    def into():  # SFT's fastest scalar loss: 3 GEMMs, grad_weight added to an fp32 main_grad
        # (weight must want a gradient: the route computes only the wanted ones)
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        out = lce.linear_cross_entropy(h, w, targets, backend="triton", grad_weight_into=main_grad)
        return torch.autograd.grad(out, (h,))

    def kept():  # the mean loss over kept logits: 3 GEMMs, the logits' memory allowed
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        out = lce.linear_cross_entropy(h, w, targets, backend="triton", keep_logits_bytes=keep)
        return torch.autograd.grad(out, (h, w))

    def fast():  # 3 GEMMs, gradients returned in the inputs' dtype
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        out = lce.linear_cross_entropy(h, w, targets, backend="triton", fast=True)
        return torch.autograd.grad(out, (h, w))

    for fn in (forward, gemm, loss, token, into, kept, fast) * 2:
        fn()  # warm-up: compiles
    pairs = [(event_ms(forward), event_ms(gemm)) for _ in range(forward_reps)]
    loss_pairs = [(event_ms(loss), event_ms(token)) for _ in range(loss_reps)]
    three_gemm = [(event_ms(into), event_ms(kept), event_ms(fast)) for _ in range(loss_reps)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = loss()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    del grads
    return {
        "lce": str(Path(lce.__file__).parent),
        "forward_ms": statistics.median(f for f, _ in pairs),
        "gemm_ms": statistics.median(g for _, g in pairs),
        "loss_ms": statistics.median(m for m, _ in loss_pairs),
        "token_ms": statistics.median(t for _, t in loss_pairs),
        "into_ms": statistics.median(i for i, _, _ in three_gemm),
        "kept_ms": statistics.median(k for _, k, _ in three_gemm),
        "fast_ms": statistics.median(f for _, _, f in three_gemm),
        "loss_peak_gib": peak,
    }


def run_tree(path: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(path)}
    cmd = [sys.executable, __file__, "--child", args.shape]
    cmd += ["--forward-reps", str(args.forward_reps), "--loss-reps", str(args.loss_reps)]
    done = subprocess.run(cmd, env=env, cwd=path, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", help="comma-separated NAME=PATH (a checkout holding lce/)")
    parser.add_argument("--shape", default="llama3-8k", choices=SHAPES)
    parser.add_argument("--reps", type=int, default=3, help="alternating runs per tree")
    parser.add_argument("--forward-reps", type=int, default=30)
    parser.add_argument("--loss-reps", type=int, default=10)
    parser.add_argument("--json", help="where to write every run's numbers")
    parser.add_argument("--child", metavar="SHAPE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.forward_reps, args.loss_reps)))
        return
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for rep in range(args.reps):
        for name, path in trees.items():
            runs[name].append(run_tree(Path(path).resolve(), args))
            print(rep, name, runs[name][-1], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "runs": runs}, indent=1))
    print(f"\n## {args.shape}: median of each tree's runs (min-max over {args.reps} runs)")
    print("| tree | " + " | ".join(FIELDS) + " |")
    print("|---" * (len(FIELDS) + 1) + "|")
    for name, results in runs.items():
        good = [r for r in results if "error" not in r]
        cells = []
        for field in FIELDS:
            values = [r[field] for r in good]
            cells.append(
                f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"
                if values
                else "error"
            )
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
