"""Machine code of lce's Triton kernels at the production shapes, compared between source trees:
which specializations a change drops costs nothing there (docs/NIGHTLY.md).

    python benchmarks/specialization_codegen.py --trees main=OLD_TREE,new=. [--json out.json]

For each tree, in a subprocess that imports that tree's `lce`, the launches of the default 4-GEMM
loss (forward, merge, target lane, the first and last d_logits chunk, a target placement) and of
the 3-GEMM loss's row kernels at llama3-8k, qwen2.5-16k and gemma2-8k (bf16, TP 1 and 8) are
captured from lce's own launchers on lazily allocated CPU tensors (nothing runs) and compiled for
sm_90 (an H100/H200) by the installed Triton, without a GPU. The table gives each launch's
instruction and spill counts per tree and whether the SASS is identical to the first tree's. Run
without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {
    "llama3-8k": (8192, 4096, 128256),
    "qwen2.5-16k": (16384, 3584, 152064),
    "gemma2-8k": (8192, 2304, 256000),
}
TP_SIZES = (1, 8)
H200_SMS = 132


def _launches(shape: str, tp: int) -> dict[str, tuple]:
    """``{launch name: (kernel, args, kwargs)}`` of one rank (the last) at ``shape`` over ``tp``."""
    import torch

    from lce.backends.base import BackwardRows, ShardStats, select_rows
    from lce.backends.triton import (
        backward_kernel,
        forward_kernel,
        loss_kernels,
        stages,
        target_kernel,
    )
    from lce.backends.triton.config import GPU_CONFIG
    from lce.options import LogitOptions

    kernels = {
        "forward": forward_kernel._forward_partials_kernel,
        "merge": forward_kernel._merge_partials_kernel,
        "target": target_kernel._target_logits_kernel,
        "d_logits": backward_kernel._dlogits_kernel,
        "place_target": target_kernel._place_target_kernel,
        "row_stats": loss_kernels._row_stats_kernel,
        "row_dlogits": loss_kernels._row_dlogits_kernel,
    }
    captured: dict[str, tuple] = {}

    def capture(name, kernel):
        def run(*args, grid, warmup, **kwargs):
            captured[name] = (kernel, args, kwargs)

        return run

    for name, kernel in kernels.items():
        kernel.run = capture(name, kernel)
    forward_kernel._persistent_programs = lambda device: H200_SMS
    num_tokens, hidden_size, vocab = SHAPES[shape]
    vocab_local = vocab // tp
    vocab_start = (tp - 1) * vocab_local
    # Untouched CPU memory: the pages are never committed.
    hidden = torch.empty(num_tokens, hidden_size, dtype=torch.bfloat16)
    weight = torch.empty(vocab_local, hidden_size, dtype=torch.bfloat16)
    targets = torch.zeros(num_tokens, dtype=torch.int64)
    launches = {}
    plain = LogitOptions()
    forward_kernel.shard_stats(hidden, weight, None, targets, vocab_start, plain, GPU_CONFIG)
    for name in ("forward", "merge", "target"):
        launches[name] = captured.pop(name)
    # As lce.autograd.token_grads builds them: fresh fp32 rows, bf16 grad_weight.
    rows = BackwardRows(*torch.empty(len(dataclasses.fields(BackwardRows)), num_tokens).unbind(0))
    grad_weight = torch.empty_like(weight)
    chunks = stages._dlogits_chunks(num_tokens, weight, grad_weight, GPU_CONFIG)
    for index in (0, len(chunks) - 1):
        chunk, buffer = chunks[index]
        backward_kernel.dlogits_chunk(
            hidden, weight[chunk], None, targets, vocab_start + chunk.start, plain, rows,
            rows.target_grad.to(weight.dtype), buffer, GPU_CONFIG,
        )  # fmt: skip
        launches[f"d_logits[{index}]"] = captured.pop("d_logits")
    launches["place_target"] = captured.pop("place_target")
    step = stages.TritonStages(GPU_CONFIG).loss_chunk_rows(num_tokens, vocab_local, hidden_size, 2)
    logits = torch.empty(step, vocab_local, dtype=torch.bfloat16)
    stats = torch.empty(len(dataclasses.fields(ShardStats)), num_tokens)
    loss_kernels.row_stats_into(logits, None, targets[:step], vocab_start, plain, stats[:, :step])
    loss_kernels.row_dlogits(
        logits, logits, None, targets[:step], vocab_start, plain, select_rows(rows, slice(step))
    )
    launches["row_stats"], launches["row_dlogits"] = (
        captured.pop("row_stats"),
        captured.pop("row_dlogits"),
    )
    for kernel in kernels.values():
        del kernel.run
    return launches


def _compile(kernel, args: tuple, kwargs: dict):
    """``kernel`` compiled for sm_90 as a launch with these arguments would compile it."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kwargs = {**kwargs, "debug": False}
    for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # read by newer Tritons' run
        if hasattr(knobs.compilation, knob):
            kwargs[knob] = getattr(knobs.compilation, knob)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    source = ASTSource(kernel, signature, constexprs, attrs)
    return compile(source, target=target, options=options.__dict__)


def _sass(cubin: bytes) -> list[str]:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():  # Triton's wheel carries one; else the CUDA toolkit's
        tool = Path(shutil.which("cuobjdump") or tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run(
            [str(tool), "-sass", file.name], capture_output=True, text=True, check=True
        ).stdout
    found = (re.match(r"\s*/\*[0-9a-f]+\*/\s*(.*?)\s*;", line) for line in text.splitlines())
    return [" ".join(m.group(1).split()) for m in found if m]


def child(shapes: list[str]) -> dict:
    rows = {}
    for shape in shapes:
        for tp in TP_SIZES:
            for name, (kernel, args, kwargs) in _launches(shape, tp).items():
                sass = _sass(_compile(kernel, args, kwargs).asm["cubin"])
                rows[f"{shape} tp{tp} {name}"] = {
                    "instructions": sum(not line.startswith("NOP") for line in sass),
                    "spills": sum(line.split()[0].startswith(("STL", "LDL")) for line in sass),
                    "sass": sass,
                }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", help="comma-separated NAME=PATH (a checkout holding lce/)")
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES)
    )
    parser.add_argument("--json", type=Path, help="write the table's rows here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the kernels must compile, not interpret")
    if args.child:
        print(json.dumps(child(args.shapes.split(","))))
        return
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        children = {}  # one process per tree, side by side: compiling is CPU work
        for name, path in trees.items():
            out = Path(folder, f"{len(children)}.json")
            env = {**os.environ, "PYTHONPATH": str(Path(path).resolve())}
            command = [sys.executable, __file__, "--child", "--shapes", args.shapes]
            with out.open("w") as file:
                children[name] = (out, subprocess.Popen(command, env=env, stdout=file))
        for name, (out, process) in children.items():
            if process.wait() != 0:
                sys.exit(f"tree {name}: the compile failed (its error is above)")
            results[name] = json.loads(out.read_text().strip().splitlines()[-1])
    first = next(iter(results))
    table = []
    header = ["launch"] + [f"{name} instr (spills)" for name in results]
    header += [f"{name} = {first}" for name in list(results)[1:]]
    print("| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|")
    for launch, base in results[first].items():
        row = {"launch": launch}
        cells = [launch]
        for name, rows in results.items():
            cells.append(f"{rows[launch]['instructions']} ({rows[launch]['spills']})")
            row[name] = {k: rows[launch][k] for k in ("instructions", "spills")}
        for name in list(results)[1:]:
            same = results[name][launch]["sass"] == base["sass"]
            cells.append("identical" if same else "differs")
            row[f"{name}_identical"] = same
        print("| " + " | ".join(cells) + " |")
        table.append(row)
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
