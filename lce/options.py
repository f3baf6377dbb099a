"""The options that travel together through the public API, autograd functions and backends.

`LogitOptions` is the logit map (and, later, the loss terms): a plain, picklable, JSON-friendly
record of Python numbers that every stage and the TP merge take as one argument. `LCEOptions` is
one call's whole set of options, the logit map among them.
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
    """How logits are formed from the raw dots ``a = hidden @ weight.T``: ``z = a / temperature``.

    Checked on construction (each bad value raises naming the argument and the fix); every field
    is a plain Python number, so the record pickles, compares and goes to JSON as
    ``dataclasses.asdict``. The stages never read the fields' formula themselves: they centre
    each lane in raw units ``r`` and scale by `centred_scale`, ``z_j - z_max = k (r_j - r_max)``.
    """

    temperature: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", _positive_real("temperature", self.temperature))

    @property
    def centred_scale(self) -> float:
        """``k``: a lane's centred logit is ``k * (r_j - r_max)`` in raw units ``r``."""
        return 1.0 / self.temperature

    @property
    def dlogit_scale(self) -> float:
        """``dz/da``: the gradient on a raw dot is this times the gradient on its logit."""
        return 1.0 / self.temperature


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
            _require_int("vocab_start", self.vocab_start, "this rank's first global id, or None")
            if self.vocab_start < 0:
                raise ValueError(f"vocab_start must be >= 0, got {self.vocab_start}")
        if not isinstance(self.reduce_grad_hidden, bool):
            raise TypeError(
                f"reduce_grad_hidden must be True or False, got {self.reduce_grad_hidden!r}"
            )
        if self.chunk_size is not None:
            _require_int("chunk_size", self.chunk_size, "tokens per chunk, or None for the default")
            if self.chunk_size < 1:
                raise ValueError(
                    f"chunk_size must be >= 1 (tokens per chunk) or None, got {self.chunk_size}"
                )


def _require_int(name: str, value: object, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int ({meaning}), got {type(value).__name__} {value!r}")


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
