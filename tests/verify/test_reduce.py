"""The reduction of a failure (`verify.running.reduce`) keeps the empty input a class of its own:
a failure with tokens shrinks to one token, never to none, and one found on no token stays
there (the smaller sizes of 0 were once 1, 2 and 3)."""

from __future__ import annotations

import pytest

from verify.running.reduce import _smaller


@pytest.mark.parametrize(("tokens", "smaller"), [(0, []), (1, []), (2, [1]), (8, [1, 2, 3, 4, 7])])
def test_token_counts_shrink_within_their_class(tokens: int, smaller: list[int]) -> None:
    assert _smaller("tokens", tokens, tp=1) == smaller


@pytest.mark.parametrize(
    ("name", "size"), [("tokens", 4097), ("vocab", 65537), ("hidden_size", 4097)]
)
def test_an_extent_halves_down_to_the_first_size_past_a_tile(name: str, size: int) -> None:
    """A failure at a 512-wide tile's tail (sizes above 512 that are no multiple of it) reduces
    from an extent's 2^k + 1 through 2049, 1025 to 513: half plus one is a move."""
    while True:
        moves = [v for v in _smaller(name, size, tp=1) if v > 512 and v % 512]
        if not moves:
            break
        size = moves[0]
    assert size == 513
