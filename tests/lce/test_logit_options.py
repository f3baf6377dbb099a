"""`lce.LogitOptions`, the one record of the logit map: checked on construction, plain data (the
harness builds it from its case spec and pickles it to workers), and agreed on by every TP rank."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import re

import pytest
import torch

import lce
from tests.helpers.checks import BACKENDS
from verify.distributed import WorkerPool


def test_the_record_is_plain_data():
    options = lce.LogitOptions(temperature=0.7)
    assert pickle.loads(pickle.dumps(options)) == options
    as_json = json.dumps(dataclasses.asdict(options))
    assert lce.LogitOptions(**json.loads(as_json)) == options
    assert all(type(v) in (float, type(None)) for v in dataclasses.asdict(options).values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.temperature = 2.0  # type: ignore[misc]
    # An int becomes a float, so equal options compare (and hash) equal whatever was passed.
    assert lce.LogitOptions(temperature=2) == lce.LogitOptions(temperature=2.0)
    assert type(lce.LogitOptions(temperature=2).temperature) is float


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0.0, ValueError, "temperature must be a finite number > 0, got 0.0"),
        (-1.0, ValueError, "temperature must be a finite number > 0"),
        (math.nan, ValueError, "temperature must be a finite number > 0, got nan"),
        (math.inf, ValueError, "temperature must be a finite number > 0, got inf"),
        ("0.7", TypeError, "temperature must be a real number"),
        (True, TypeError, "temperature must be a real number"),
        (torch.tensor(0.7), TypeError, r"temperature must be a Python number, got a tensor"),
    ],
)
def test_bad_temperatures_raise_naming_it(value, error, message):
    with pytest.raises(error, match=message):
        lce.LogitOptions(temperature=value)
    hidden, weight, targets = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(error, match=message):
        lce.token_logprobs(hidden, weight, targets, temperature=value)


def test_lce_options_carry_the_logit_record():
    options = lce.LCEOptions(logit=lce.LogitOptions(temperature=0.5))
    assert options.logit.temperature == 0.5 and options.logit.centred_scale == 2.0
    with pytest.raises(TypeError, match=r"logit must be an lce\.LogitOptions"):
        lce.LCEOptions(logit={"temperature": 0.5})


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(world_size=2, timeout_s=60) as workers:
        yield workers


def _errors(pool, backend, per_rank_options):
    payload = {"backend": backend, "options": per_rank_options}
    results = pool.run("tests.helpers.option_jobs:call_with_rank_options", payload, tp=2)
    return [r["error"] for r in results]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_option_on_one_rank_raises_on_every_rank(pool, backend):
    """Before, the rank with the bad temperature raised while the other waited in the call's
    first collective: a hang (here, the pool's 60 s timeout)."""
    errors = _errors(pool, backend, [{"temperature": 1.0}, {"temperature": 0.0}])
    assert re.fullmatch(
        "ValueError: another rank of the TP group rejected its arguments.*", errors[0]
    )
    assert errors[1] == "ValueError: temperature must be a finite number > 0, got 0.0"


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_with_different_options_all_raise(pool, backend):
    """Each rank alone is valid; together they would compute a softmax no rank asked for."""
    errors = _errors(pool, backend, [{"temperature": 1.0}, {"temperature": 0.5}])
    assert len(set(errors)) == 1 and "different logit options" in errors[0], errors
    assert _errors(pool, backend, [{"temperature": 0.5}, {"temperature": 0.5}]) == ["", ""]
