"""One call resolved inside lce's ops: the backend's stages, this rank's vocab shard, options."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lce.backends import get_stages, resolve_backend_name
from lce.backends.base import StageBackend
from lce.backends.torch_chunked import default_chunk_size
from lce.call import Call
from lce.options import LCEOptions
from lce.tp import CallShape, VocabShard, agree_on_call, logit_key, resolve_shard, usable_group


@dataclass(frozen=True)
class Plan:
    """One call, resolved: the caller's options, this rank's vocab shard, the backend's stages."""

    options: LCEOptions
    shard: VocabShard
    stages: StageBackend


def plan_call(
    call: Call, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, agree: bool
) -> Plan:
    """Pick the stages and the shard; with ``agree`` (a forward), first agree with the TP group's
    other ranks on the call (`agree_on_call`: every rank raises alike where any rank cannot run
    it). The arguments were checked by `lce.api` already; only the backend is resolved here.

    A backward does not agree again: its chunks need not match across ranks (its one collective
    sums whole gradients), so the torch backend's default chunk follows this rank's own shard.
    """
    options = call.options
    group = usable_group(options.tp_group)
    try:
        backend = resolve_backend_name(options.backend, hidden.device, weight.dtype)
    except (TypeError, ValueError) as error:
        if group is not None and agree:
            agree_on_call(group, None, error)  # the other ranks raise too, then this one
        raise
    chunk_size = options.chunk_size
    if group is not None and agree:
        shape = CallShape(
            targets.numel(), weight.shape[0], options.vocab_start is not None,
            logit_key(options.logit),
        )  # fmt: skip
        largest_shard = agree_on_call(group, shape, None)
        if backend == "torch" and chunk_size is None:
            # The scalar-loss path merges per chunk: every rank must cut the tokens alike.
            chunk_size = default_chunk_size(largest_shard)
    return Plan(
        options=options,
        shard=resolve_shard(group, options.vocab_start, weight.shape[0]),
        stages=get_stages(backend, hidden.device, chunk_size),
    )
