"""`torch.compile(fullgraph=True)` of lce's entry points: no graph break, one graph for every token
count after the first two, and the same outputs and gradients as eager, bit for bit.

Bit for bit, not within a tolerance: lce's ops are opaque custom ops (`lce.ops`), so the compiled
graph calls the same eager code on the same tensors; Inductor computes none of lce's numerics (the
graph test below shows that the only call in Dynamo's graph is the op). Any difference is a bug
(a fake implementation or autograd formula that disagrees with the op), not rounding.

Inductor compiles the commonest calls; the others use the ``aot_eager`` compiler, which traces
them the same way (Dynamo, the fake implementations at a symbolic token count, AOTAutograd's
forward/backward partition and the functionalization of the op that adds to the caller's
buffer) without Inductor's C++ build of the glue around the op, seconds per graph on a CPU.
"""

from __future__ import annotations

import operator
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Before the kernels' import (@triton.jit picks the interpreter at decoration time).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers.compiled_calls import (
    ALL_OPTIONS,
    MAP_OPTIONS,
    TOKEN_COUNTS,
    compiled_and_eager,
    entry,
    problem,
)
from verify.distributed import WorkerPool

MAP_ONLY = {name: ALL_OPTIONS[name] for name in MAP_OPTIONS}
# (path, options, compiler): every loss path with the logit map, bias, z-loss and smoothing (the
# per-token path takes the map only; plain calls trace alike, the options being op arguments).
CASES = [
    ("tokens", MAP_ONLY, "inductor"), ("loss", ALL_OPTIONS, "inductor"),
    ("fast", ALL_OPTIONS, "aot_eager"), ("into", ALL_OPTIONS, "aot_eager"),
]  # fmt: skip


def _check(result) -> None:
    assert result["graph_breaks"] == 0
    # Dynamo compiles the first count as static shapes and the second as a dynamic token count
    # (automatic dynamic shapes); every count after that reuses the dynamic graph.
    assert result["graphs"] == 2, result["graphs"]
    for tokens, (compiled, eager) in zip(TOKEN_COUNTS, result["runs"], strict=True):
        names = ["output 0", "output 1", "grad_hidden", "grad_weight", "grad_bias"]
        for name, got, want in zip(names, compiled, eager, strict=True):
            assert torch.equal(got, want), f"{name} at {tokens} tokens differs from eager"


@pytest.mark.parametrize(
    ("path", "options", "compiler"), CASES, ids=[f"{p}-{bool(o)}-{c}" for p, o, c in CASES]
)
def test_torch_backend_compiles_whole_and_matches_eager(path, options, compiler):
    _check(compiled_and_eager(path, options, "torch", compiler=compiler))


@pytest.mark.parametrize("path", ["tokens", "loss"])
def test_triton_backend_compiles_whole_and_matches_eager(path):
    pytest.importorskip("triton")
    options = MAP_ONLY if path == "tokens" else ALL_OPTIONS
    # Inductor on the GPU (compiled kernels, CUDA tensors); the interpreter's CPU run traces alike.
    compiler = "inductor" if torch.cuda.is_available() else "aot_eager"
    _check(compiled_and_eager(path, options, "triton", compiler=compiler))


def test_the_graph_holds_lce_as_one_opaque_op():
    """Inductor is never handed lce's numerics: Dynamo's graph calls `lce::fused` and only
    takes items of its result."""
    graphs = []

    def keep(graph_module, example_inputs):
        graphs.append(graph_module.graph)
        return graph_module.forward

    torch._dynamo.reset()
    call = entry("loss", ALL_OPTIONS, "torch")
    inputs = problem(9, seed=1)
    torch.compile(call, backend=keep, fullgraph=True)(
        inputs["hidden"], inputs["weight"].requires_grad_(), inputs["bias"], inputs["targets"]
    )
    (graph,) = graphs
    calls = [node.target for node in graph.nodes if node.op == "call_function"]
    assert [t for t in calls if t is not operator.getitem] == [torch.ops.lce.fused]


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(world_size=2, timeout_s=120) as workers:
        yield workers


def test_vocab_parallel_compiles_whole_and_matches_eager(pool):
    """Each rank of a gloo TP group of 2 compiles its call (the group travels by name into the
    op, where the TP merge's collectives run)."""
    payload = {"path": "loss", "options": ALL_OPTIONS, "backend": "torch", "compiler": "aot_eager"}
    for result in pool.run("tests.helpers.compiled_calls:compiled_against_eager", payload, tp=2):
        _check(result)
