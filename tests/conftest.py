"""Shared test set-up: Triton runs in its CPU interpreter when no GPU is present."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported anywhere in the test process.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(items: list) -> None:
    """The tests marked ``slow`` (about 15 s or more each) first, in collection order: with
    ``ci/test``'s one-test scheduling chunks the two workers share them from the start, and the
    quick tests fill in around them, rather than one worker ending the run on a long test."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
