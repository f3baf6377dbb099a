"""What the gradient GEMMs' output dtypes cost: cuBLAS through torch at the loss paths' shapes.

    PYTHONPATH=. python benchmarks/gemm_variants.py --json OUT.json

Per shape (kernel_gpu.SHAPES), median ms of: one ``hidden @ weight.T`` (the floor's unit); the
3-GEMM path's chunk GEMMs (`TritonStages.loss_chunk_rows` token rows): logits in bf16, grad_hidden
rows in fp32 (K = V), grad_weight of the chunk written in bf16, written in fp32, and added into an
fp32 buffer (`gemm.addmm_`: cuBLAS's beta = 1 epilogue reads and writes the fp32 [V, H] once);
and the 4-GEMM backward's grad_hidden accumulation step (fp32 [T, H] += d_logits @ weight chunk)
at chunk widths 512 to 32768. Each timing alternates with the floor GEMM.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from kernel_gpu import SHAPES, time_ms  # same folder

from lce.backends.gemm import addmm_, mm_into
from lce.backends.triton import TritonStages

WIDTHS = (512, 2048, 8192, 32768)


def shape_timings(num_tokens: int, hidden_size: int, vocab: int) -> dict[str, float]:
    """The timings of one shape (module docstring), ms."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.02).bfloat16()
    rows = TritonStages().loss_chunk_rows(num_tokens, vocab, hidden_size, 2)
    chunk = torch.randn(rows, vocab, device="cuda", generator=gen).bfloat16() * 1e-3
    grad_hidden = torch.empty(rows, hidden_size, device="cuda")
    grad_weight = torch.empty(vocab, hidden_size, device="cuda")
    grad_weight_low = torch.empty(vocab, hidden_size, device="cuda", dtype=torch.bfloat16)
    part = hidden[:rows]
    calls = {
        "logits_chunk_bf16": lambda: mm_into(part, weight.T, out=chunk),
        "grad_hidden_chunk_fp32": lambda: mm_into(chunk, weight, out=grad_hidden),
        "grad_weight_chunk_bf16": lambda: mm_into(chunk.T, part, out=grad_weight_low),
        "grad_weight_chunk_fp32": lambda: mm_into(chunk.T, part, out=grad_weight),
        "grad_weight_chunk_added_fp32": lambda: addmm_(grad_weight, chunk.T, part),
    }
    sums = torch.empty(num_tokens, hidden_size, device="cuda")
    for width in WIDTHS:
        d_logits = torch.randn(num_tokens, width, device="cuda", generator=gen).bfloat16()
        calls[f"grad_hidden_step_w{width}"] = lambda d=d_logits, w=width: addmm_(
            sums, d, weight[:w]
        )
    out = {"chunk_rows": rows}
    for name, call in calls.items():
        out[name] = time_ms(call, iters=10)
        out[f"{name}_floor"] = time_ms(lambda: hidden @ weight.T)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    report = {}
    for shape in args.shapes.split(","):
        report[shape] = shape_timings(*SHAPES[shape])
        print(shape, {k: round(v, 3) for k, v in report[shape].items()}, flush=True)
        torch.cuda.empty_cache()
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
