"""A memo of a function of one case spec, bounded by its cases' sizes as well as their count: a
large case (`verify.cases.spec.EXTENTS`) holds tensors thousands of times a small one's, and 64
of them outgrew a 24 GiB machine (the test suite's worker was killed at 10 GB)."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from verify.cases.spec import CaseSpec

# Elements (of logits, weight and hidden) the cases of one memo may hold together: one wide case
# at TP 4 (8 x 262149 logits, a 262149 x 16 weight) or many long ones, besides every small one.
MAX_ELEMENTS = 1 << 23


def elements(spec: CaseSpec) -> int:
    """The case's logits, weight and hidden elements: what its tensors' sizes scale with."""
    tokens = spec.num_tokens
    return tokens * spec.vocab + (spec.vocab + tokens) * spec.hidden_size


def sized_memo(max_items: int, max_elements: int = MAX_ELEMENTS) -> Callable:
    """``fn(spec)`` memoized within ``max_items`` cases and ``max_elements`` (`_evict`); safe
    to call from several threads (the oracle is computed ahead on one). ``cache_clear()``
    empties it."""

    def wrap(fn: Callable[[CaseSpec], Any]) -> Callable[[CaseSpec], Any]:
        store: OrderedDict[CaseSpec, Any] = OrderedDict()
        lock = threading.Lock()

        def call(spec: CaseSpec) -> Any:
            with lock:
                if spec in store:
                    store.move_to_end(spec)
                    return store[spec]
            value = fn(spec)
            with lock:
                store[spec] = value
                _evict(store, max_items, max_elements)
            return value

        call.cache_clear = store.clear  # type: ignore[attr-defined]
        return functools.update_wrapper(call, fn)

    return wrap


def _evict(store: OrderedDict[CaseSpec, Any], max_items: int, max_elements: int) -> None:
    """Least recently used out past ``max_items``; past ``max_elements``, the least recently used
    of the cases larger than an equal share (a large case does not flush the small ones, whose
    tensors are what it exceeds the budget by a thousandth of). The newest is always kept."""
    while len(store) > max_items:
        store.popitem(last=False)
    share = max_elements // max_items
    held = sum(elements(spec) for spec in store)
    for spec in list(store)[:-1]:
        if held <= max_elements:
            break
        if elements(spec) > share:
            del store[spec]
            held -= elements(spec)
