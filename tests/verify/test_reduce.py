"""The reduction of a failure (`verify.running.reduce`) keeps the empty input a class of its own:
a failure with tokens shrinks to one token, never to none, and one found on no token stays
there (the smaller sizes of 0 were once 1, 2 and 3)."""

from __future__ import annotations

import pytest

from verify.running.reduce import _smaller


@pytest.mark.parametrize(("tokens", "smaller"), [(0, []), (1, []), (2, [1]), (8, [1, 2, 3, 4, 7])])
def test_token_counts_shrink_within_their_class(tokens: int, smaller: list[int]) -> None:
    assert _smaller("tokens", tokens, tp=1) == smaller
