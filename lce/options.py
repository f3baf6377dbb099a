"""The options that travel together through the public API, autograd functions and backends.

`LogitOptions` is the logit map and the loss terms: a plain, picklable, JSON-friendly record of
Python numbers that every stage and the TP merge take as one argument. `LCEOptions` is one call's
whole set of options, the logit record among them.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

REDUCTIONS = ("none", "sum", "mean")


@dataclass(frozen=True, kw_only=True)
class LogitOptions:
    """The logit map and the loss terms of one call.

    Logits ``z = cap * tanh(s * (hidden @ weight.T + bias) / cap) / T`` with ``s`` the
    ``logit_scale``, ``cap`` the ``softcap`` (without one: ``z = s * (hidden @ weight.T + bias) /
    T``) and ``T`` the ``temperature``. Per-token loss ``(1 - eps) * (lse - z_y) +
    eps * mean_j(lse - z_j) + c * lse**2`` with ``eps`` the ``label_smoothing`` (the mean over the
    whole vocabulary, PyTorch's definition) and ``c`` the ``z_loss`` coefficient (the term is
    added only when ``c > 0``).

    Checked on construction (each bad value raises naming the argument and the fix); every field
    is a plain Python number or None, so the record pickles, compares and goes to JSON as
    ``dataclasses.asdict``. The stages never read the formula themselves: each lane has a raw
    unit ``r`` (``a + b``; with a cap ``tanh(s (a + b) / cap)``, the map being monotone) and its
    logit centred on the row max is ``k (r_j - r_max)``, ``k`` the `centred_scale`.
    """

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None
    z_loss: float = 0.0
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        for name in ("temperature", "logit_scale"):
            object.__setattr__(self, name, _positive_real(name, getattr(self, name)))
        if self.softcap is not None:
            cap = _real("softcap", self.softcap, "30.0 (or None for no cap)")
            if not (math.isfinite(cap) and cap > 0):
                raise ValueError(f"softcap must be a finite number > 0 or None (no cap), got {cap}")
            object.__setattr__(self, "softcap", cap)
        z_loss = _real("z_loss", self.z_loss, "1e-4 (the coefficient of lse**2)")
        if not (math.isfinite(z_loss) and z_loss >= 0):
            raise ValueError(f"z_loss must be a finite coefficient >= 0, got {z_loss}")
        eps = _real("label_smoothing", self.label_smoothing, "0.1")
        if not 0.0 <= eps <= 1.0:  # NaN fails too
            raise ValueError(f"label_smoothing must be in [0, 1], got {eps}")
        object.__setattr__(self, "z_loss", z_loss)
        object.__setattr__(self, "label_smoothing", eps)

    @property
    def centred_scale(self) -> float:
        """``k``: a lane's centred logit is ``k * (r_j - r_max)`` in raw units ``r``."""
        if self.softcap is not None:
            return self.softcap / self.temperature
        return self.logit_scale / self.temperature

    @property
    def cap_scale(self) -> float:
        """``s / cap``: what multiplies ``a + b`` inside the tanh (only with a softcap)."""
        return self.logit_scale / (self.softcap or 1.0)

    @property
    def dlogit_scale(self) -> float:
        """``s / T``: ``dz/da`` is this times the cap's slope ``1 - tanh^2`` (1 without a cap)."""
        return self.logit_scale / self.temperature


@dataclass(frozen=True, kw_only=True)
class LCEOptions:
    """How to compute; see `lce.token_logprobs` for each field's meaning.

    Keyword-only, and checked on construction: each bad value raises naming the argument and the
    fix.
    """

    ignore_index: int = -100
    logit: LogitOptions = field(default_factory=LogitOptions)
    tp_group: dist.ProcessGroup | None = None
    vocab_start: int | None = None
    reduce_grad_hidden: bool = True
    backend: str = "auto"
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        _require_int("ignore_index", self.ignore_index, "the label of ignored tokens, e.g. -100")
        if not isinstance(self.logit, LogitOptions):
            raise TypeError(f"logit must be an lce.LogitOptions, got {type(self.logit).__name__}")
        if self.vocab_start is not None:
            require_at_least("vocab_start", self.vocab_start, 0, "this rank's first global id")
        if not isinstance(self.reduce_grad_hidden, bool):
            raise TypeError(
                f"reduce_grad_hidden must be True or False, got {self.reduce_grad_hidden!r}"
            )
        if self.chunk_size is not None:
            require_at_least("chunk_size", self.chunk_size, 1, "tokens per chunk, or None")
        for name in ("ignore_index", "vocab_start", "chunk_size"):  # plain ints (`lce.call`)
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))


def _require_int(name: str, value: object, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int ({meaning}), got {type(value).__name__} {value!r}")


def require_at_least(name: str, value: object, minimum: int, meaning: str) -> None:
    """``value`` an int (a symbolic one under torch.compile too) >= ``minimum``, else an error
    naming ``name`` and what it means."""
    _require_int(name, value, meaning)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} ({meaning}), got {value}")


def _real(name: str, value: object, example: str) -> float:
    """``value`` as a Python float; a tensor or a non-number raises naming ``name``."""
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} must be a Python number, got a tensor; pass float({name}) "
            f"(lce takes no gradient with respect to the {name})"
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number such as {example}, got {type(value).__name__} {value!r}"
        )
    return float(value)


def _positive_real(name: str, value: object) -> float:
    value = _real(name, value, "1.0")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value
