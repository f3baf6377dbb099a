"""One TP rank's inputs of a case: its vocab rows, the memory layouts, the faults, the tied hidden.

`verify.cases.build` draws the global problem; `rank_inputs` cuts this rank's share out of it and
shapes it the way the spec says the implementation receives it. Everything a rank feeds an
implementation is decided here, so lce and every adapter see the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from lce.dtensor import is_dtensor
from lce.options import LogitOptions
from verify.cases.build import Problem, tied_hidden
from verify.cases.layouts import with_layout
from verify.cases.spec import CaseSpec
from verify.numerics.reference import IGNORE_INDEX

# The grads choices under which each leaf requires grad.
_HIDDEN_GRADS = ("both", "hidden", "twice")
_WEIGHT_GRADS = ("both", "weight", "twice")


@dataclass(frozen=True)
class RankInputs:
    """The leaves of one rank (``hidden`` shaped like the targets plus ``H``; ``weight`` and
    ``bias`` this rank's rows), the targets, and the other arguments of the call (``options``:
    the model options, possibly a fault's unchecked bad value).

    ``embed_ids`` is set for a tied case: the implementation then receives ``hidden + TIE_SCALE *
    weight[embed_ids]`` (`head_hidden`), so gradients reach the weight through both uses.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    options: LogitOptions
    vocab_start: int | None
    embed_ids: torch.Tensor | None
    ignore_index: int = IGNORE_INDEX
    bias: torch.Tensor | None = None

    @property
    def leaves(self) -> list[torch.Tensor]:
        """``hidden``, ``weight`` and ``bias``, those that require grad, in that order."""
        return [t for t in self.named_leaves().values() if t.requires_grad]

    def named_leaves(self) -> dict[str, torch.Tensor]:
        """Every leaf by name (``hidden``, ``weight``, ``bias`` when the head has one)."""
        named = {"hidden": self.hidden, "weight": self.weight, "bias": self.bias}
        return {name: t for name, t in named.items() if t is not None}

    def head_hidden(self) -> torch.Tensor:
        """What the implementation receives as hidden: the leaf, or base + embedding when tied
        (a fresh graph on every call, as each forward of a tied model builds its own)."""
        if self.embed_ids is None:
            return self.hidden
        flat = self.hidden.reshape(-1, self.hidden.shape[-1])
        return tied_hidden(flat, self.weight, self.embed_ids).view(self.hidden.shape)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of the inputs (a DTensor's local tensor), to check afterwards that the
        implementation left them alone."""
        inputs = {**self.named_leaves(), "targets": self.targets}
        return {k: _local(t).detach().clone() for k, t in inputs.items()}

    def unchanged_since(self, snapshot: dict[str, torch.Tensor]) -> bool:
        """Every input still has the snapshot's values and dtype."""
        return all(
            torch.equal(before, _local(getattr(self, k)).detach())
            and before.dtype == getattr(self, k).dtype
            for k, before in snapshot.items()
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor


def rank_inputs(spec: CaseSpec, problem: Problem, tp_rank: int) -> RankInputs:
    """Rank ``tp_rank``'s inputs of ``spec`` from its global ``problem`` (already on the device)."""
    start, stop = vocab_range(spec, tp_rank)
    shape = spec.target_shape()
    tied = spec.tied and spec.transform != "untie"
    leaf_hidden = problem.hidden_base if tied else problem.hidden
    # An untied rerun feeds lce a contiguous hidden, as the tied run's base + embedding is.
    layout = "contiguous" if spec.transform == "untie" else spec.layout
    hidden = with_layout(leaf_hidden.view(*shape, spec.hidden_size), layout)
    weight = with_layout(problem.weight[start:stop], spec.layout)
    bias = None if problem.bias is None else problem.bias[start:stop].clone()
    targets = problem.targets.clone()
    options = spec.logit_options(effective_temperature(spec))
    if spec.fault == "target_ge_vocab":
        targets[-1] = spec.vocab
    elif spec.fault == "target_negative":
        targets[0] = -2 if problem.ignore_index == -1 else -1  # negative, not the ignore_index
    elif spec.fault == "hidden_size_mismatch":
        weight = torch.cat([weight, torch.ones_like(weight[:, :1])], dim=1)
    elif spec.fault == "bias_length":
        bias = weight.new_zeros(stop - start + 1)
    elif spec.fault in _BAD_OPTIONS:
        options = _unchecked(options, **_BAD_OPTIONS[spec.fault])
    targets = targets.view(shape)
    if spec.fault == "targets_float":
        targets = targets.float()
    hidden.requires_grad_(spec.grads in _HIDDEN_GRADS)
    weight.requires_grad_(spec.grads in _WEIGHT_GRADS)
    if bias is not None:
        bias.requires_grad_(spec.grads in _WEIGHT_GRADS)  # the head's parameters train together
    embed_ids = problem.embed_ids if tied else None
    return RankInputs(
        hidden, weight, targets, options, explicit_vocab_start(spec, tp_rank), embed_ids,
        problem.ignore_index, bias,
    )  # fmt: skip


# The option faults: the bad value each passes (an unchecked `LogitOptions` carries it to the call).
_BAD_OPTIONS = {
    "temperature_zero": {"temperature": 0.0},
    "temperature_nan": {"temperature": float("nan")},
    "softcap_zero": {"softcap": 0.0},
    "smoothing_above_one": {"label_smoothing": 1.5},
}


def _unchecked(options: LogitOptions, **bad: float) -> LogitOptions:
    """``options`` with ``bad`` values its constructor would refuse, for the implementation to
    refuse (the harness passes the record's fields as the call's arguments)."""
    record = object.__new__(LogitOptions)
    for f in fields(options):
        object.__setattr__(record, f.name, bad.get(f.name, getattr(options, f.name)))
    return record


def effective_temperature(spec: CaseSpec) -> float:
    """The temperature passed to the implementation: 1 when the transform folded it into hidden."""
    return 1.0 if spec.transform == "fold_temperature" else spec.temperature


def vocab_range(spec: CaseSpec, tp_rank: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``tp_rank``'s weight rows at ``spec.tp``."""
    return spec.shard_bounds()[tp_rank]


def explicit_vocab_start(spec: CaseSpec, tp_rank: int) -> int | None:
    """None (lce's default ``rank * V_local``) for equal shards, else the rank's first id."""
    return None if spec.even_shards else vocab_range(spec, tp_rank)[0]


def upstream_view(grad: torch.Tensor, spec: CaseSpec, shape: tuple[int, ...]) -> torch.Tensor:
    """An upstream gradient shaped like the output, in the spec's memory pattern."""
    grad = grad.view(shape)
    if spec.upstream == "expanded" and grad.numel():
        return grad.reshape(-1)[:1].view([1] * len(shape) or []).expand(shape)
    if spec.upstream == "strided":
        wide = torch.zeros(*shape, 2, dtype=grad.dtype, device=grad.device)
        wide[..., 0] = grad
        return wide[..., 0]
    return grad
