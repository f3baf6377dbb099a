"""The compiled property: the implementation under ``torch.compile(fullgraph=True)`` gives what it
gives in eager, within the tiers of the differential property, forward and backward.

For implementations that claim compile support on the spec's backend (`Capabilities.compiles`).
The worker compiles the adapter's callables once per process, every size of the call's tensors
marked dynamic from the first example (sizes 0 and 1 excepted, which Dynamo specializes), so a
verdict never depends on the sizes earlier examples compiled (a new dtype or option value
recompiles), runs
the case through them as `verify.execution.execute` runs any case, and the compiled run is judged
like an eager one: against R and B with the spec's tiers, plus a flag saying whether it equals the
eager run bit for bit (an opaque custom op, lce's, should). A graph break (``fullgraph`` raises
on it), a compile error or an exception in the compiled call fails the property, naming it.
The main_grad loss path is not compiled here: the harness's own main_grad set-up (random old
content seeded on the host) is not traceable; lce's tests compile that path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch._functorch.config

from verify.adapters.interface import Adapter
from verify.adapters.registry import resolve
from verify.cases.spec import CaseSpec
from verify.execution.execute import LocalRank, Rank, case_payload, fatal_device_error, run_payload
from verify.execution.outcome import assemble
from verify.execution.runner import Runner
from verify.properties.oracle import oracle
from verify.properties.verdict import PropertyVerdict, flag, refused, tolerance_check, tolerance_for

JOB = "verify.properties.compiled:compiled_job"
# Inductor on CUDA (what users run); on the CPU the aot_eager compiler traces alike (Dynamo, the
# fake implementations, AOTAutograd's partition and functionalization) without Inductor's C++
# build of every graph, seconds each on a CPU.
COMPILERS = {"cuda": "inductor", "cpu": "aot_eager"}
RECOMPILE_LIMIT = 64
_COMPILED: dict[tuple[str, str, str], Any] = {}  # (adapter ref, callable, device): compiled


def applies(spec: CaseSpec) -> bool:
    """Plain weights (DTensor weights under compile are claimed by no one here), no main_grad."""
    return spec.loss_path != "main_grad" and spec.dtensor == "none"


def compiled(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """Under torch.compile(fullgraph=True), outputs and gradients pass the eager tiers."""
    if spec.backend not in runner.adapter.capabilities.compiles:
        return []
    eager = runner.run(spec)
    if eager.status != "ok":
        return [refused("compiled", spec, eager.error)]
    payload = case_payload(spec, runner.adapter.ref, runner.mutant)

    def here() -> list[dict]:
        local = LocalRank(torch.device(runner.adapter.device))
        return [run_compiled(payload, local, runner.adapter)]

    run = assemble(spec, runner.run_job(JOB, payload, spec, here))
    if run.status != "ok":
        return [flag("compiled", spec, "status", False, f"under torch.compile: {run.error}")]
    exp = oracle(spec)
    verdicts = []
    for name, value in run.outputs.items():
        tol = tolerance_for(spec, name)
        args = ("compiled", spec, name, value, exp.ref[name], exp.base[name], tol)
        verdicts.append(tolerance_check(*args, returned=run.dtypes.get(name)))
    same = sorted(n for n, v in run.outputs.items() if torch.equal(v, eager.outputs.get(n, v)))
    detail = f"bit-equal to eager: {same}; outputs {sorted(run.outputs)}"
    verdicts.append(
        flag("compiled", spec, "outputs", set(run.outputs) == set(eager.outputs), detail)
    )
    return verdicts


def compiled_job(payload: dict[str, Any], rank: Rank) -> dict[str, Any]:
    """A worker's entry: ``payload`` from `verify.execution.execute.case_payload`."""
    return run_compiled(payload, rank, resolve(payload["impl"]))


def run_compiled(payload: dict[str, Any], rank: Rank, adapter: Adapter) -> dict[str, Any]:
    """The case through ``adapter``'s callables compiled (`compiled_adapter`); an exception
    raised while compiling or running them becomes ``status="raised"`` with its message."""
    try:
        # A search meets more input classes than one cache holds: the run starts a fresh cache
        # then (`verify.execution.execute.as_in_a_fresh_process`).
        return run_payload(payload, rank, compiled_adapter(adapter, torch.device(rank.device)))
    except Exception as exc:
        if fatal_device_error(exc):
            raise
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return {
            "status": "raised",
            "error_type": type(exc).__name__,
            "error": " | ".join(lines)[:500],
        }


def compiled_adapter(adapter: Adapter, device: torch.device) -> Adapter:
    """``adapter`` with its callables under ``torch.compile(fullgraph=True)``,
    compiled once per process (Dynamo's guards decide the recompiles), refusing nothing (an
    exception under compile is the property's failure, not a refusal of the input)."""
    compiler = COMPILERS.get(device.type, "inductor")
    # A case past Dynamo's recompile limit would run in eager unnoticed: raise instead, and
    # allow one graph per dtype pair, option set and input layout a search meets.
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    # Option values (temperature, softcap, chunk_size, ...) are constants of lce's op; by default
    # Dynamo traces a Python number that changed between calls as a symbol, which lce cannot
    # encode into its op's call (docs/DESIGN.md, "torch.compile"): one graph per value instead.
    torch._dynamo.config.specialize_float = True
    torch._dynamo.config.specialize_int = True
    # AOTAutograd donates a backward's saved buffers once it has run without retain_graph, and
    # refuses retain_graph on that graph afterwards, for any compiled code (measured with plain
    # torch ops too): a property of the compiler, which a search mixing grads="twice" with
    # single backwards in one worker would pin on the implementation.
    torch._functorch.config.donated_buffer = False
    functions = {}
    for name in ("token_outputs", "loss"):
        fn = getattr(adapter, name)
        key = (adapter.ref or adapter.name, name, device.type)
        if fn is not None and key not in _COMPILED:
            _COMPILED[key] = torch.compile(fn, backend=compiler, fullgraph=True)
        functions[name] = None if fn is None else _sizes_dynamic(_COMPILED[key])
    return replace(adapter, refusals=(), **functions)


def _sizes_dynamic(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every dimension of the call's tensors marked dynamic (sizes 0 and 1 stay
    Dynamo's specializations): every case meets the graph that other sizes of the same dimension
    would bring, whichever sizes this process compiled before, so a verdict depends on the case
    alone and its artifact replays in a fresh process. (lce once wrote a budget computed from the
    sizes into its op's call text: it failed only once an earlier example had another size.)"""

    def run(call: Any, *args: Any) -> Any:
        for tensor in (call.hidden, call.weight, call.targets, call.bias):
            for dim in range(0 if tensor is None else tensor.dim()):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return fn(call, *args)

    return run
