"""Adapters: how the harness calls an implementation, what it claims, and the built-in ones (lce's
own among them). `resolve` selects one by built-in name or ``module:function``
(docs/verify-your-kernel.md); a campaign of it is `verify.running.campaign.run_campaign`.
"""

from verify.adapters.interface import (
    Adapter,
    AdapterError,
    Call,
    Capabilities,
    Limits,
    NumericalContract,
)
from verify.adapters.registry import from_loss_fn, names, resolve

__all__ = [
    "Adapter",
    "AdapterError",
    "Call",
    "Capabilities",
    "Limits",
    "NumericalContract",
    "from_loss_fn",
    "names",
    "resolve",
]
