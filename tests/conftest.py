"""Shared test set-up: Triton runs in its CPU interpreter when no GPU is present."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported anywhere in the test process.
    os.environ.setdefault("TRITON_INTERPRET", "1")
