"""One call of lce's custom ops, as the ``str`` argument they take (`lce.ops`).

A custom op's schema takes tensors and plain values only, so everything else a call needs (the
loss path, the `LCEOptions`, the reduction, which gradients are wanted) travels as one string:
``repr`` of a dict of plain Python values, written field by field from the options' dataclass
fields, so a new option needs no schema change. The TP group goes by its name
(``group.group_name``), resolved again in the op. `torch.compile` traces `encode_call` to a
constant (``repr`` of constants folds); `decode_call` runs inside the op, where the options are
built (and checked) again from the plain values.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, fields

import torch.distributed as dist

from lce.backends.base import Wanted
from lce.options import LCEOptions, LogitOptions

# The loss paths (routes) the ops run: per-token outputs, the default (4-GEMM) loss, the 3-GEMM
# loss with gradients computed in the forward (`fast`) and the 3-GEMM loss into a caller's buffer.
ROUTES = ("tokens", "loss", "fast", "into")
NO_GRADS = Wanted(False, False, False)
# The options' field names, read once: `torch.compile` traces a loop over constant names, not
# `dataclasses.fields` of a class.
_LOGIT_FIELDS = tuple(f.name for f in fields(LogitOptions))
_OTHER_FIELDS = tuple(f.name for f in fields(LCEOptions) if f.name not in ("logit", "tp_group"))


@dataclass(frozen=True)
class Call:
    """What a call of `lce.ops` carries besides its tensors."""

    route: str
    options: LCEOptions
    reduction: str = "none"
    wanted: Wanted = NO_GRADS  # gradients of hidden, weight, bias
    assumed_loss_grad: float = 1.0  # the `into` route's assumed upstream
    keep_logits: bool = False  # the forward keeps the logits for the backward (`keeps_logits`)


def keeps_logits(
    route: str, wanted: Wanted, tokens: int, vocab_local: int, itemsize: int, budget: int
) -> bool:
    """Whether a call keeps this rank's ``[tokens, vocab_local]`` logits (``itemsize`` bytes
    each) from its forward for its backward: a route that recomputes them (``tokens``, ``loss``),
    a gradient wanted, and the logits within the caller's ``budget`` (``keep_logits_bytes``).

    Decided before the op, so the op and its fake read one flag: under torch.compile a budget
    computed from a symbolic token count stays symbolic, and only this comparison (a guard, or
    none where it holds for every size) reaches the graph, not the budget itself.
    """
    if route not in ("tokens", "loss") or not any(wanted) or budget <= 0:
        return False
    # A branch, not bool(): Dynamo evaluates a symbolic comparison it branches on (bool() of
    # one stays symbolic, and a symbolic value cannot be written into the call's text).
    if tokens * vocab_local * itemsize <= budget:  # noqa: SIM103 (see above)
        return True
    return False


def encode_call(call: Call) -> str:
    """``call`` as a string of plain Python literals (`decode_call` reverses it)."""
    options = call.options
    group = options.tp_group
    plain = {
        "route": call.route,
        "reduction": call.reduction,
        "wanted": tuple(bool(flag) for flag in call.wanted),
        "assumed_loss_grad": float(call.assumed_loss_grad),
        "keep_logits": bool(call.keep_logits),
        "group": None if group is None else group.group_name,
        "logit": {name: getattr(options.logit, name) for name in _LOGIT_FIELDS},
        "options": {name: getattr(options, name) for name in _OTHER_FIELDS},
    }
    return repr(plain)


def decode_call(text: str) -> Call:
    """The `Call` that `encode_call` wrote (its options checked again on construction; the TP
    group looked up by name at each call, since a name is reused after a group is destroyed)."""
    plain = _literal(text)
    group = None if plain["group"] is None else _resolve_group(plain["group"])
    options = LCEOptions(logit=LogitOptions(**plain["logit"]), tp_group=group, **plain["options"])
    return Call(
        route=plain["route"],
        options=options,
        reduction=plain["reduction"],
        wanted=Wanted(*plain["wanted"]),
        assumed_loss_grad=plain["assumed_loss_grad"],
        keep_logits=plain["keep_logits"],
    )


def _resolve_group(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


class _NonFinite(ast.NodeTransformer):
    """``inf`` and ``nan`` as ``repr`` writes them, the only names a call's text may hold."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id not in ("inf", "nan"):
            raise ValueError(f"lce call text holds the name {node.id!r}; it is not a literal")
        return ast.Constant(float(node.id))


@functools.lru_cache(maxsize=256)
def _literal(text: str) -> dict:
    """The plain values of ``text`` (cached: callers read the dict, never change it)."""
    tree = _NonFinite().visit(ast.parse(text, mode="eval"))
    return ast.literal_eval(tree.body)
