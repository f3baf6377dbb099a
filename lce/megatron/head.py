"""The LM head a megatron-core output layer really multiplies with: weight shard, TP group, vocab
range, sequence parallelism; and the layer configurations the fused path does not reproduce."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.utils import VocabUtility


@dataclass(frozen=True)
class OutputHead:
    """What the stock layer would use: ``weight`` ``[V_local, H]`` holds global ids
    ``[vocab_start, vocab_start + V_local)``; ``sequence_parallel`` means hidden arrives as this
    rank's ``[S / tp, B, H]`` slice and must be gathered first."""

    weight: torch.Tensor
    tp_group: dist.ProcessGroup | None
    vocab_start: int
    sequence_parallel: bool


def resolve_head(output_layer: torch.nn.Module, weight: torch.Tensor | None) -> OutputHead:
    """The head of ``output_layer`` (a ``ColumnParallelLinear``) called with ``weight=weight``.

    ``weight`` is what the model passes to the layer (the shared embedding weight with tied
    embeddings); None means the layer's own ``weight``. The TP group is the layer's own
    ``tp_group`` (the model's process-group collection), else megatron-core's parallel state.
    """
    used = _used_weight(output_layer, weight)
    group = tp_group_of(output_layer)
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    vocab_start, _ = VocabUtility.vocab_range_from_per_partition_vocab_size(
        used.shape[0], rank, world
    )
    sequence_parallel = bool(getattr(output_layer, "sequence_parallel", False)) and world > 1
    return OutputHead(used, group, vocab_start, sequence_parallel)


def tp_group_of(output_layer: torch.nn.Module) -> dist.ProcessGroup | None:
    """The layer's own ``tp_group``, else megatron-core's TP group; None without TP."""
    group = getattr(output_layer, "tp_group", None)
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    return group


def _used_weight(output_layer: torch.nn.Module, weight: torch.Tensor | None) -> torch.Tensor:
    if weight is None:
        weight = getattr(output_layer, "weight", None)
        if weight is None:
            raise ValueError(
                "output_layer.weight is None (skip_weight_param_allocation, as with tied "
                "embeddings): pass the weight the model uses, e.g. "
                "weight=model.shared_embedding_or_output_weight()"
            )
    expected = (
        getattr(output_layer, "output_size_per_partition", weight.shape[0]),
        getattr(output_layer, "input_size", weight.shape[1]),
    )
    if tuple(weight.shape) != tuple(expected):
        raise ValueError(
            f"weight has shape {tuple(weight.shape)} but the output layer expects its vocab shard "
            f"{tuple(expected)} ([V / tp, H]); pass this rank's shard, not the full or "
            "transposed matrix"
        )
    return weight


def check_output_layer(output_layer: torch.nn.Module) -> None:
    """Raise unless ``output_layer`` follows ColumnParallelLinear's contract (GPTModel's head)."""
    if not all(hasattr(output_layer, a) for a in ("tp_group", "sequence_parallel", "config")):
        raise TypeError(
            f"output_layer must be megatron-core's ColumnParallelLinear (GPTModel.output_layer), "
            f"got {type(output_layer).__name__}; for a plain [V, H] weight call "
            "lce.token_logprobs directly"
        )


def unsupported_reason(output_layer: torch.nn.Module) -> str | None:
    """Why the fused path cannot reproduce a ColumnParallelLinear's stock result, or None."""
    config = output_layer.config
    if type(output_layer).forward is not ColumnParallelLinear.forward:
        # e.g. a MuP readout multiplying the logits: what it computes is not lce's to guess.
        return (
            f"an output layer whose forward is not ColumnParallelLinear's "
            f"({type(output_layer).__name__}.forward; pass its logit scale or cap through "
            "FusedOutputOptions and use ColumnParallelLinear)"
        )
    if getattr(output_layer, "bias", None) is not None and not output_layer.skip_bias_add:
        return "an output-layer bias added to the logits"
    if getattr(config, "defer_embedding_wgrad_compute", False):
        return "config.defer_embedding_wgrad_compute (the stock layer defers its weight gradient)"
    if getattr(output_layer, "disable_grad_reduce", False):
        return "output_layer.disable_grad_reduce (the caller reduces the input gradient itself)"
    if getattr(output_layer, "explicit_expert_comm", False):
        return "an expert-parallel output layer"
    return None
