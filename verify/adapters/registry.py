"""Select an implementation by built-in name or by ``module:function`` (``--impl``, ``--lce-impl``).

``module:function`` may name an `Adapter`, a zero-argument factory returning one, or a plain loss
function ``fn(hidden, weight, targets, *, reduction=..., ignore_index=..., softcap=..., ...)``
whose keyword parameters say what it supports (`from_loss_fn`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
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


# The keyword names peers give each model option (`verify.cases.spec.OPTION_FIELDS`, the logits
# ``cap * tanh(s * (h @ W.T + b) / cap) / T``, the loss's ``+ c * lse**2`` and PyTorch's label
# smoothing): a plain loss function with one of them claims the option and gets its value by
# that name. Liger names the z-loss coefficient ``lse_square_scale``, OLMo ``z_loss_multiplier``,
# PyTorch the bias ``linear_bias``, Gemma's config the cap ``final_logit_softcapping``.
OPTION_KEYWORDS = {
    "temperature": ("temperature",),
    "logit_scale": ("logit_scale",),
    "softcap": ("softcap", "softcapping", "logit_softcapping", "final_logit_softcapping"),
    "bias": ("bias", "linear_bias"),
    "z_loss": ("z_loss", "lse_square_scale", "z_loss_multiplier", "z_loss_weight"),
    "label_smoothing": ("label_smoothing",),
}


def option_keywords(params: Iterable[str]) -> dict[str, str]:
    """Each model option the keyword names ``params`` take, with the name it goes by."""
    names = set(params)
    found = {}
    for option, keywords in OPTION_KEYWORDS.items():
        taken = [k for k in keywords if k in names]
        if len(taken) > 1:
            raise AdapterError(f"keywords {taken} all name the option {option}: keep one")
        if taken:
            found[option] = taken[0]
    return found


def _option_value(call: Call, option: str) -> object:
    return call.bias if option == "bias" else getattr(call.options, option)


def from_loss_fn(fn: Callable[..., torch.Tensor], name: str | None = None) -> Adapter:
    """Wrap ``fn(hidden [N, H], weight [V, H], targets [N], *, reduction, ignore_index, ...)``
    returning the loss (per token for ``reduction='none'``). Only the keyword parameters it has
    are passed and claimed: without ``reduction`` only ``mean`` is tested (and there are no
    per-token log-probs), without ``ignore_index`` no token is ignored, and each model option
    named by one of its keywords (`OPTION_KEYWORDS`) is generated; the others are listed as not
    tested. Outputs may be in the input dtype (``outputs='input'``)."""
    params = inspect.signature(fn).parameters
    has = {key: key in params for key in ("reduction", "ignore_index")}
    options = option_keywords(params)

    def loss_2d(call: Call, reduction: str) -> torch.Tensor:
        kwargs: dict[str, object] = {k: _option_value(call, o) for o, k in options.items()}
        if has["reduction"]:
            kwargs["reduction"] = reduction
        if has["ignore_index"]:
            kwargs["ignore_index"] = call.ignore_index
        return fn(call.hidden, call.weight, call.targets, **kwargs)

    caps = Capabilities(
        reductions=REDUCTIONS if has["reduction"] else ("mean",),
        ignore_index=has["ignore_index"],
        options=tuple(options),
    )
    return flat_loss_adapter(
        name or getattr(fn, "__name__", "loss"), loss_2d, capabilities=caps,
        contract=NumericalContract(logits="input", outputs="input"),
        description=f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}",
    )  # fmt: skip
