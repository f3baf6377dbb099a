"""Select an implementation by built-in name or by ``module:function`` (``--impl``, ``--lce-impl``).

``module:function`` may name an `Adapter`, a zero-argument factory returning one, or a plain loss
function ``fn(hidden, weight, targets, *, reduction=..., ignore_index=...)`` whose keyword
parameters say what it supports (`from_loss_fn`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import replace
from functools import cache

import torch

from verify.adapters.builtin import BUILTIN, flat_loss_adapter
from verify.adapters.interface import (
    Adapter,
    AdapterError,
    Call,
    Capabilities,
    NumericalContract,
)
from verify.cases.spec import REDUCTIONS


def resolve(name_or_path: str | Adapter) -> Adapter:
    """The adapter for a built-in name (`names()`), a ``module:function`` path, or an `Adapter`.

    The result's ``ref`` is the string that resolves it again (in a worker process or a replay).
    """
    if isinstance(name_or_path, Adapter):
        return name_or_path
    return _resolve(str(name_or_path))


@cache
def _resolve(ref: str) -> Adapter:
    if ref in BUILTIN:
        adapter = BUILTIN[ref]()
    elif ":" in ref:
        adapter = _from_path(ref)
    else:
        raise AdapterError(
            f"unknown implementation {ref!r}; use a built-in name ({', '.join(names())}) "
            "or 'module:function'"
        )
    return replace(adapter, ref=ref)


def names() -> tuple[str, ...]:
    """Built-in adapter names (some need a package or CUDA when resolved)."""
    return tuple(BUILTIN)


def _from_path(ref: str) -> Adapter:
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AdapterError(f"--impl {ref!r}: cannot import module {module_name!r} ({exc})") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError as exc:
        raise AdapterError(f"--impl {ref!r}: module {module_name!r} has no {attr!r}") from exc
    if isinstance(obj, Adapter):
        return obj
    if not callable(obj):
        raise AdapterError(f"--impl {ref!r}: {attr!r} is neither an Adapter nor callable")
    required = [
        p
        for p in inspect.signature(obj).parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if not required:
        adapter = obj()
        if not isinstance(adapter, Adapter):
            raise AdapterError(f"--impl {ref!r}: the factory returned {type(adapter).__name__}")
        return adapter
    return from_loss_fn(obj, name=attr)


def from_loss_fn(fn: Callable[..., torch.Tensor], name: str | None = None) -> Adapter:
    """Wrap ``fn(hidden [N, H], weight [V, H], targets [N], *, reduction, ignore_index)``
    returning the loss (per token for ``reduction='none'``). Only the keyword parameters it has
    are passed and claimed: without ``reduction`` only ``mean`` is tested (and there are no
    per-token log-probs), without ``ignore_index`` no token is ignored. Temperature stays 1 (write
    an `Adapter` to test it). Outputs may be in the input dtype (``outputs='input'``)."""
    params = inspect.signature(fn).parameters
    has = {key: key in params for key in ("reduction", "ignore_index")}

    def loss_2d(call: Call, reduction: str) -> torch.Tensor:
        kwargs: dict[str, object] = {}
        if has["reduction"]:
            kwargs["reduction"] = reduction
        if has["ignore_index"]:
            kwargs["ignore_index"] = call.ignore_index
        return fn(call.hidden, call.weight, call.targets, **kwargs)

    caps = Capabilities(
        reductions=REDUCTIONS if has["reduction"] else ("mean",),
        ignore_index=has["ignore_index"],
    )
    adapter = flat_loss_adapter(
        name or getattr(fn, "__name__", "loss"), loss_2d, capabilities=caps,
        contract=NumericalContract(logits="input", outputs="input"),
        description=f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}",
    )  # fmt: skip
    if has["reduction"]:
        return adapter
    return replace(adapter, outputs=("loss",), token_outputs=None)
