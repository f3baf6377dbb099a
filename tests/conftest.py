"""Shared test set-up: Triton runs in its CPU interpreter when no GPU is present."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported anywhere in the test process.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(items: list) -> None:
    """The tests marked ``slow`` (tens of seconds each) first, the others in their order: with
    one test handed out at a time (ci/test's ``--maxschedchunk 1``), the workers start on the
    long ones and end together, not with one of them running a long test alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
