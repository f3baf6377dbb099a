"""The graph_replay property: one forward and backward captured in a CUDA graph, replayed with a
new problem's inputs copied into the captured buffers, gives what eager gives on that problem.

For implementations that claim it on the spec's backend (`Capabilities.graph_capture`), on a CUDA
worker (on the CPU it adds no verdict, and the campaign lists it as not tested there): a kernel that
syncs with the host (illegal while capturing), allocates its outputs outside the graph's pool,
reads a host copy of an input, or bakes a value of the first inputs into the capture fails here.
Compared bit for bit: a replay launches the kernels eager launches, on the same values.
"""

from __future__ import annotations

import torch

from verify.adapters.interface import Adapter, Call
from verify.cases.build import build
from verify.cases.rank_inputs import RankInputs, rank_inputs, upstream_view
from verify.cases.spec import CaseSpec
from verify.execution.execute import Rank, on_device
from verify.execution.mutants import applied
from verify.execution.runner import Runner
from verify.properties.verdict import PropertyVerdict, flag

CHECK = "verify.properties.graph_replay:check_replay"


def applies(spec: CaseSpec) -> bool:
    """One rank, plain gradients of hidden and weight, the default loss path, some tokens."""
    default_path = spec.loss_path == "default" and spec.dtensor == "none"
    return spec.tp == 1 and spec.grads == "both" and default_path and spec.num_tokens > 0


def graph_replay(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """A CUDA-graph replay with new inputs equals eager on them (outputs and gradients)."""
    if spec.backend not in runner.adapter.capabilities.graph_capture:
        return []
    return runner.run_check(CHECK, spec)


def check_replay(
    spec: CaseSpec, adapter: Adapter, mutant: str | None, rank: Rank
) -> list[PropertyVerdict]:
    """Capture on ``spec``'s inputs, replay on those of ``spec`` with the next seed, compare
    with eager on the latter; no verdict off CUDA."""
    device = torch.device(rank.device)
    if device.type != "cuda":
        return []
    new_spec = spec.with_(seed=spec.seed + 1)
    with applied(mutant):
        static, new = (_Step(s, adapter, device) for s in (spec, new_spec))
        try:
            graph, captured = _capture(static)
        except RuntimeError as error:
            return [flag("graph_replay", spec, "capture", False, f"capture failed: {error}"[:300])]
        static.copy_from(new)
        graph.replay()
        torch.cuda.synchronize(device)
        replayed = [t.clone() for t in captured]
        eager = new.run()
    names = new.names
    return [
        flag("graph_replay", spec, name, same_bits(got, want), "replay vs eager, bit for bit")
        for name, got, want in zip(names, replayed, eager, strict=True)
    ]


def _capture(static: _Step) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """``static.run`` captured (after two warm-up runs on a side stream: compiles, cuBLAS)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            static.run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = static.run()
    return graph, outputs


class _Step:
    """One forward and backward of ``adapter`` on ``spec``'s inputs (the leaves, targets and
    upstream gradients stay the same tensors from run to run: a capture's buffers)."""

    def __init__(self, spec: CaseSpec, adapter: Adapter, device: torch.device) -> None:
        problem = on_device(build(spec), device)
        self.spec, self.adapter = spec, adapter
        self.inputs: RankInputs = rank_inputs(spec, problem, 0)
        shape = spec.target_shape()
        self.upstream = {
            "logprobs": upstream_view(problem.grad_logprob, spec, shape),
            "entropy": None
            if problem.grad_entropy is None
            else upstream_view(problem.grad_entropy, spec, shape),
            "loss": problem.grad_loss
            if spec.reduction != "none"
            else upstream_view(problem.grad_loss, spec, shape),
        }
        self.names: list[str] = []

    def call(self) -> Call:
        x = self.inputs
        return Call(
            x.head_hidden(), x.weight, x.targets, ignore_index=x.ignore_index, options=x.options,
            vocab_start=x.vocab_start, backend=self.spec.backend, chunk_size=self.spec.chunk_size,
            bias=x.bias,
        )  # fmt: skip

    def run(self) -> list[torch.Tensor]:
        """The outputs, then the gradients of ``sum(output * upstream)`` w.r.t. the leaves."""
        outputs: dict[str, torch.Tensor] = {}
        if self.adapter.token_outputs is not None:
            got = self.adapter.token_outputs(self.call())
            outputs.update({n: got[n] for n in ("logprobs", "entropy") if n in got})
        if self.adapter.loss is not None:
            outputs["loss"] = self.adapter.loss(self.call(), self.spec.reduction)
        pairs = [(o, self.upstream[n]) for n, o in outputs.items() if self.upstream[n] is not None]
        ends, upstreams = zip(*pairs, strict=True)
        leaves = self.inputs.leaves
        grads = torch.autograd.grad(ends, leaves, upstreams, allow_unused=True)
        grads = [
            torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves, strict=True)
        ]
        names = [n for n, leaf in self.inputs.named_leaves().items() if leaf.requires_grad]
        self.names = [*outputs, *(f"grad_{n}" for n in names)]
        return [*outputs.values(), *grads]

    def copy_from(self, other: _Step) -> None:
        """``other``'s values into this step's tensors (same shapes: only the seed differs)."""
        with torch.no_grad():
            mine, theirs = self.inputs.named_leaves(), other.inputs.named_leaves()
            for name, tensor in mine.items():
                tensor.copy_(theirs[name])
            self.inputs.targets.copy_(other.inputs.targets)
            if self.inputs.embed_ids is not None:  # a tied case's lookup runs inside the graph
                self.inputs.embed_ids.copy_(other.inputs.embed_ids)
            for name, tensor in self.upstream.items():
                if tensor is not None:
                    _write(tensor, other.upstream[name])


def _write(into: torch.Tensor, values: torch.Tensor) -> None:
    """``values`` into ``into``; an expanded view (stride 0: one value for every token) is written
    through one element of each, since a copy into overlapping memory is refused."""
    if 0 in into.stride() and into.numel():
        index = (0,) * into.dim()
        into[index].copy_(values[index])
    else:
        into.copy_(values)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal values with NaNs at the same places (a mean over no valid token is NaN in both)."""
    nan = got.isnan()
    return torch.equal(nan, want.isnan()) and torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
