"""The dtensor property: a DTensor weight gives what the plain tensors it implies give, bit for bit,
and its gradients come back as DTensors of its mesh and placements.

For implementations that claim DTensor weights (`Capabilities.dtensor_weights`), on the specs
that give the weight (and bias) as a DTensor (`CaseSpec.dtensor`, built by
`verify.execution.dtensor_leaves`). The plain twin of a Shard(0) case is the same case with this
rank's rows as plain tensors, the TP group and each shard's offset as ``vocab_start`` (the rows
torch.chunk gives, as explicit shards); of a Replicate case, the whole weight at TP = 1. Both runs
are judged against R by the other properties; this one holds them to each other exactly: a
DTensor is a layout, not another computation.
"""

from __future__ import annotations

from verify.cases.spec import CaseSpec, chunk_sizes
from verify.execution.runner import Runner
from verify.properties.verdict import PropertyVerdict, exact_check, flag, refused

NAME = "dtensor"


def applies(spec: CaseSpec) -> bool:
    return spec.dtensor != "none"


def plain_twin(spec: CaseSpec) -> CaseSpec:
    """The case with the plain tensors ``spec``'s DTensor weight implies."""
    if spec.dtensor == "shard0":
        return spec.with_(dtensor="none", shards=chunk_sizes(spec.vocab, spec.tp))
    return spec.with_(dtensor="none", tp=1, shards=None)


def dtensor_weights(spec: CaseSpec, runner: Runner) -> list[PropertyVerdict]:
    """A DTensor weight equals its plain tensors bit for bit; gradients keep its placement."""
    twin = plain_twin(spec)
    if spec.dtensor not in runner.adapter.capabilities.dtensor_weights:
        return []
    got, plain = runner.run(spec), runner.run(twin)
    for run, on in ((got, spec), (plain, twin)):
        if run.status != "ok":
            return [refused(NAME, on, run.error)]
    verdicts = [
        exact_check(NAME, spec, name, got.outputs[name], plain.outputs[name])
        for name in got.outputs
        if name in plain.outputs
    ]
    verdicts.append(
        flag(NAME, spec, "outputs", set(got.outputs) == set(plain.outputs),
             f"outputs {sorted(got.outputs)}, the plain tensors' {sorted(plain.outputs)}")
    )  # fmt: skip
    lines = "; ".join(got.grad_layouts)
    verdicts.append(
        flag(NAME, spec, "grad_placement", not got.grad_layouts,
             lines or f"every gradient a DTensor of its leaf's placement ({spec.dtensor})")
    )  # fmt: skip
    return verdicts
