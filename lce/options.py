"""The options that travel together through the public API, autograd functions and backends."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist

REDUCTIONS = ("none", "sum", "mean")


@dataclass(frozen=True, kw_only=True)
class LCEOptions:
    """How to compute; see `lce.token_logprobs` for each field's meaning.

    Keyword-only, and checked on construction: each bad value raises naming the argument and the
    fix (``temperature`` becomes a Python float).
    """

    ignore_index: int = -100
    temperature: float = 1.0
    tp_group: dist.ProcessGroup | None = None
    vocab_start: int | None = None
    reduce_grad_hidden: bool = True
    backend: str = "auto"
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        _require_int("ignore_index", self.ignore_index, "the label of ignored tokens, e.g. -100")
        object.__setattr__(self, "temperature", _checked_temperature(self.temperature))
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


def _checked_temperature(value: object) -> float:
    if isinstance(value, torch.Tensor):
        raise TypeError(
            "temperature must be a Python number, got a tensor; pass float(temperature) "
            "(lce takes no gradient with respect to the temperature)"
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"temperature must be a real number such as 1.0, got {type(value).__name__} {value!r}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {value}")
    return float(value)
