"""Malformed arguments: the same clear error on both backends and both entry points."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lce
from tests.helpers.checks import BACKENDS

T, H, V = 4, 8, 5


def _call(entry, backend, hidden=None, weight=None, targets=None, **options):
    hidden = torch.randn(T, H, requires_grad=True) if hidden is None else hidden
    weight = torch.randn(V, H) if weight is None else weight
    targets = torch.tensor([0, 1, 2, 3]) if targets is None else targets
    return entry(hidden, weight, targets, backend=backend, **options)


@pytest.mark.parametrize("entry", [lce.token_logprobs, lce.linear_cross_entropy])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (dict(hidden=np.zeros((T, H), np.float32)), TypeError, "hidden must be a torch.Tensor"),
        (dict(hidden=[[0.0] * H] * T), TypeError, "hidden must be a torch.Tensor"),
        (dict(targets=[0, 1, 2, 3]), TypeError, "targets must be a torch.Tensor"),
        (dict(ignore_index=None), TypeError, "ignore_index must be an int"),
        (dict(temperature="1.0"), TypeError, "temperature must be a real number"),
        (dict(temperature=torch.tensor(0.5)), TypeError, "pass float\\(temperature\\)"),
        (dict(chunk_size=0), ValueError, "chunk_size must be >= 1"),
        (dict(chunk_size=2.5), TypeError, "chunk_size must be an int"),
        (dict(vocab_start=-1), ValueError, "vocab_start must be >= 0"),
        (dict(reduce_grad_hidden="no"), TypeError, "reduce_grad_hidden must be True or False"),
        (
            dict(hidden=torch.zeros(T, 0), weight=torch.zeros(V, 0)),
            ValueError,
            "hidden size .* must be >= 1",
        ),
    ],
)
def test_malformed_arguments_name_the_argument_and_the_fix(
    entry, backend, arguments, error, message
):
    with pytest.raises(error, match=message):
        _call(entry, backend, **arguments)
