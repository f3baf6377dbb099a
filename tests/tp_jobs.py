"""A worker-side job for the TP tests: a rank's inputs from the harness, passed to lce without
``vocab_start`` (which unequal shards need)."""

from __future__ import annotations

import lce
from verify.cases.build import build
from verify.cases.rank_inputs import rank_inputs
from verify.cases.spec import CaseSpec
from verify.distributed import JobContext


def without_vocab_start(payload: str, ctx: JobContext) -> None:
    """``payload``: CaseSpec JSON; lce must refuse the rank's shard (it raises in the worker)."""
    spec = CaseSpec.from_json(payload)
    inputs = rank_inputs(spec, build(spec), ctx.tp_rank)
    lce.token_logprobs(inputs.hidden, inputs.weight, inputs.targets, tp_group=ctx.tp_group)
