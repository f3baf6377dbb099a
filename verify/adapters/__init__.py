"""Verify any linear cross-entropy implementation through an adapter (docs/verify-your-kernel.md).

`resolve` selects one by built-in name or ``module:function``; `check_impl` searches it under a
profile; `replay_impl` re-runs a saved failure through it.
"""

from verify.adapters.check import ImplReport, check_impl
from verify.adapters.impl_replay import replay_impl
from verify.execution.interface import (
    Adapter,
    AdapterError,
    Call,
    Capabilities,
    Limits,
    NumericalContract,
)
from verify.execution.selection import from_loss_fn, names, resolve

__all__ = [
    "Adapter",
    "AdapterError",
    "Call",
    "Capabilities",
    "ImplReport",
    "Limits",
    "NumericalContract",
    "check_impl",
    "from_loss_fn",
    "names",
    "replay_impl",
    "resolve",
]
