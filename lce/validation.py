"""Input checks of the public API: each error names the argument and says how to fix it.

Checks of tensor *values* (target ids, the upstream gradient grad_weight_into assumed) run on the
host where that costs no device sync (`host_checks`), else as device-side asserts.
"""

from __future__ import annotations

import os

import torch

from lce.options import REDUCTIONS

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> None:
    """Types, shapes, dtypes and devices (`LCEOptions` checks the options itself); target *values*
    are checked after the shard merge."""
    for name, value in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor, got {type(value).__name__}; "
                f"convert it with torch.as_tensor({name})"
            )
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [T, H] or [B, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(
            f"weight must be the [V_local, H] LM-head shard, got {tuple(weight.shape)}"
        )
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden's last dim ({hidden.shape[-1]}) must equal weight's dim 1 "
            f"({weight.shape[1]}); "
            "pass weight as [vocab, hidden] (not transposed)"
        )
    if weight.shape[1] == 0:
        raise ValueError(
            f"the hidden size (hidden's last dim, weight's dim 1) must be >= 1, got shapes "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets must have shape {tuple(hidden.shape[:-1])} (hidden without its last dim), "
            f"got {tuple(targets.shape)}"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be int64 or int32 token ids, got {targets.dtype}")
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{name} must be a floating tensor in {FLOAT_DTYPES}, got {tensor.dtype}"
            )
    if not hidden.device == weight.device == targets.device:
        raise ValueError(
            f"hidden, weight and targets must be on one device, got {hidden.device}, "
            f"{weight.device}, {targets.device}"
        )
    if bias is not None:
        check_bias(bias, weight)


def check_bias(bias: torch.Tensor, weight: torch.Tensor) -> None:
    """The LM head's bias: ``[V_local]`` (this rank's entries, sharded like the weight's rows),
    in weight's dtype and on its device."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(
            f"bias must be a torch.Tensor [V_local] or None, got {type(bias).__name__}; "
            "convert it with torch.as_tensor(bias)"
        )
    if tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"bias must be [V_local] = ({weight.shape[0]},), this rank's entries like weight's "
            f"rows, got shape {tuple(bias.shape)}"
        )
    if bias.dtype != weight.dtype:
        raise ValueError(
            f"bias must have weight's dtype {weight.dtype}, got {bias.dtype}; "
            f"pass bias.to({weight.dtype})"
        )
    if bias.device != weight.device:
        raise ValueError(f"bias must be on weight's device {weight.device}, got {bias.device}")


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


# "1": value checks read the data on the host (named errors; a sync each on CUDA), "0": device-side
# asserts (no sync). Unset: each check's default (`host_checks`).
HOST_CHECKS_ENV = "LCE_HOST_CHECKS"

# What a failed device-side target check prints (CUDA then fails every later call on the device).
TARGETS_ASSERT = (
    "lce: targets hold ids outside [0, V) that are not ignore_index, or ids that several TP "
    f"shards hold (a wrong vocab_start); {HOST_CHECKS_ENV}=1 raises a ValueError naming them"
)


def host_checks(device: torch.device, default: bool = False) -> bool:
    """Whether a value check may read ``device`` data on the host (on CUDA: a host sync).

    Always off CUDA (the CPU has no sync to avoid); never while the current CUDA stream is being
    captured into a graph (a sync is illegal there); else as `HOST_CHECKS_ENV` says, else
    ``default``.
    """
    if device.type != "cuda":
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    return host_checks_setting(default)


def host_checks_setting(default: bool) -> bool:
    """`HOST_CHECKS_ENV` read now: ``"1"`` True, ``"0"`` False, unset or empty ``default``."""
    value = os.environ.get(HOST_CHECKS_ENV, "")
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(
            f"{HOST_CHECKS_ENV} must be 1 (check values on the host: named errors, one host sync "
            f"each on CUDA), 0 (device-side asserts, no sync) or unset, got {value!r}"
        )
    return value == "1"


def check_target_ids(targets: torch.Tensor, owners: torch.Tensor, ignore_index: int) -> None:
    """Every non-ignored target id must be held by exactly one vocab shard.

    ``owners [T]`` counts the shards holding each target: 0 means outside ``[0, V)``, more than 1
    means the shards overlap (a wrong ``vocab_start``). Where `host_checks` allows (CPU, or CUDA
    with ``LCE_HOST_CHECKS=1`` outside graph capture) a `ValueError` names the ids; on CUDA by
    default a device-side assert, with no host sync, fails the stream with `TARGETS_ASSERT`.
    """
    if host_checks(targets.device):
        raise_on_bad_targets(targets, owners, ignore_index)
    else:
        assert_target_ids(targets, owners, ignore_index)


def assert_target_ids(targets: torch.Tensor, owners: torch.Tensor, ignore_index: int) -> None:
    """`check_target_ids` as a device-side assert (on the CPU it raises RuntimeError at once)."""
    bad = (targets != ignore_index) & (owners != 1)
    torch._assert_async(~bad.any(), TARGETS_ASSERT)


def raise_on_bad_targets(targets: torch.Tensor, owners: torch.Tensor, ignore_index: int) -> None:
    """`check_target_ids` on the host: a `ValueError` naming the bad ids (one host sync)."""
    active = targets != ignore_index
    # One host sync for the common case (all valid); it is the caller's last step, so the GPU
    # has the rest of the forward queued behind it.
    if not bool((active & (owners != 1)).any()):
        return
    for bad, problem, fix in (
        (active & (owners == 0), "outside the vocabulary [0, V)", "fix the labels or mark them "
         f"with ignore_index={ignore_index}"),
        (active & (owners > 1), "held by more than one TP rank's vocab shard",
         "pass each rank's vocab_start so the shards do not overlap"),
    ):  # fmt: skip
        if bool(bad.any()):
            bad_ids = torch.unique(targets[bad]).tolist()
            shown = ", ".join(str(i) for i in bad_ids[:10]) + (" ..." if len(bad_ids) > 10 else "")
            raise ValueError(f"targets holds ids {problem}: {shown}; {fix}")
