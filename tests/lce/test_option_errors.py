"""Bad option values raise ValueError/TypeError naming the argument, on both entry points and both
backends, and under TP on every rank alike (one rank's bad value, or ranks that disagree)."""

from __future__ import annotations

import math
import re

import pytest
import torch

import lce
from tests.helpers.checks import BACKENDS
from verify.distributed import WorkerPool

HIDDEN, WEIGHT, TARGETS = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 4])
BAD_VALUES = [
    ("softcap", 0.0, ValueError, "softcap must be a finite number > 0 or None"),
    ("softcap", -30.0, ValueError, "softcap must be a finite number > 0 or None"),
    ("softcap", math.nan, ValueError, "softcap must be a finite number > 0 or None"),
    ("softcap", math.inf, ValueError, "softcap must be a finite number > 0 or None"),
    ("softcap", "30", TypeError, "softcap must be a real number"),
    ("softcap", torch.tensor(30.0), TypeError, "softcap must be a Python number, got a tensor"),
    ("logit_scale", 0.0, ValueError, "logit_scale must be a finite number > 0"),
    ("logit_scale", -2.0, ValueError, "logit_scale must be a finite number > 0"),
    ("logit_scale", math.nan, ValueError, "logit_scale must be a finite number > 0"),
    ("logit_scale", math.inf, ValueError, "logit_scale must be a finite number > 0"),
    ("logit_scale", None, TypeError, "logit_scale must be a real number"),
]
LOSS_ONLY = [
    ("z_loss", -1e-4, ValueError, "z_loss must be a finite coefficient >= 0"),
    ("z_loss", math.nan, ValueError, "z_loss must be a finite coefficient >= 0"),
    ("z_loss", math.inf, ValueError, "z_loss must be a finite coefficient >= 0"),
    ("label_smoothing", -0.1, ValueError, r"label_smoothing must be in \[0, 1\]"),
    ("label_smoothing", 1.5, ValueError, r"label_smoothing must be in \[0, 1\]"),
    ("label_smoothing", math.nan, ValueError, r"label_smoothing must be in \[0, 1\]"),
    ("return_z_loss", 1, TypeError, "return_z_loss must be True or False"),
]
BAD_BIASES = [
    ([0.0] * 5, TypeError, "bias must be a torch.Tensor"),
    (torch.zeros(6), ValueError, r"bias must be \[V_local\] = \(5,\)"),
    (torch.zeros(5, 1), ValueError, r"bias must be \[V_local\] = \(5,\)"),
    (torch.zeros(5, dtype=torch.float64), ValueError, "bias must have weight's dtype"),
    (torch.zeros(5, device="meta"), ValueError, "bias must be on weight's device"),
]


def _ids(cases):
    return [f"{case[0]}={case[1]!r}" if isinstance(case[0], str) else repr(case[0])[:30]
            for case in cases]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "value", "error", "message"), BAD_VALUES, ids=_ids(BAD_VALUES))
def test_bad_map_options_raise_on_both_entry_points(backend, name, value, error, message):
    with pytest.raises(error, match=message):
        lce.token_logprobs(HIDDEN, WEIGHT, TARGETS, backend=backend, **{name: value})
    with pytest.raises(error, match=message):
        lce.linear_cross_entropy(HIDDEN, WEIGHT, TARGETS, backend=backend, **{name: value})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "value", "error", "message"), LOSS_ONLY, ids=_ids(LOSS_ONLY))
def test_bad_loss_terms_raise(backend, name, value, error, message):
    with pytest.raises(error, match=message):
        lce.linear_cross_entropy(HIDDEN, WEIGHT, TARGETS, backend=backend, **{name: value})


def test_the_per_token_path_takes_no_loss_terms():
    """z-loss and label smoothing are loss terms: `token_logprobs` has no such argument."""
    for name in ("z_loss", "label_smoothing"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            lce.token_logprobs(HIDDEN, WEIGHT, TARGETS, **{name: 0.1})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("bias", "error", "message"), BAD_BIASES, ids=_ids(BAD_BIASES))
def test_bad_biases_raise_naming_the_argument(backend, bias, error, message):
    for fn in (lce.token_logprobs, lce.linear_cross_entropy):
        with pytest.raises(error, match=message):
            fn(HIDDEN, WEIGHT, TARGETS, bias=bias, backend=backend)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(world_size=2, timeout_s=60) as workers:
        yield workers


def _errors(pool, backend, options, bias_rows=None):
    payload = {"backend": backend, "options": options, "bias_rows": bias_rows}
    results = pool.run("tests.helpers.option_jobs:call_with_rank_options", payload, tp=2)
    return [r["error"] for r in results]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("options", "bias_rows", "bad"),
    [
        ([{}, {"softcap": 0.0}], None, "ValueError: softcap must be"),
        ([{"label_smoothing": 2.0}, {}], None, r"ValueError: label_smoothing must be in \[0, 1\]"),
        ([{}, {}], [4, 5], r"ValueError: bias must be \[V_local\]"),
    ],
    ids=["softcap", "label_smoothing", "bias"],
)
def test_one_ranks_bad_option_raises_on_every_rank(pool, backend, options, bias_rows, bad):
    errors = _errors(pool, backend, options, bias_rows)
    bad_rank = next(i for i, o in enumerate(options) if o) if any(options) else 1
    assert re.match(bad, errors[bad_rank]), errors
    assert "another rank of the TP group rejected its arguments" in errors[1 - bad_rank], errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_with_different_caps_all_raise(pool, backend):
    errors = _errors(pool, backend, [{"softcap": 30.0}, {"softcap": None}])
    assert len(set(errors)) == 1 and "different logit options" in errors[0], errors
