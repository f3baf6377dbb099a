"""Worker of `test_megatron_options`: lce.megatron with logit options on real megatron-core objects
(ColumnParallelLinear, GPTModel) at TP = 2 over gloo, one spawned process per rank.

Each case appends ``{"case", "passed", "detail"}`` rows; the worker writes its rank's rows as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import types
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers.option_reference import IGNORE, make_problem, reference

TP = 2
PROBLEM = make_problem(seed=6, tokens=12, hidden_size=16, vocab=74)  # 37 rows per rank
MAP = {"temperature": 0.7, "logit_scale": 1.3, "softcap": 5.0}
# fp32, as tests/lce/test_logit_map.py's bound (same logit magnitudes, O(1) Lipschitz constants).
REL = 1e-5
MUP_MULTIPLIER = 0.25


class Rows(list):
    def check(self, case: str, ok: bool, detail: str) -> None:
        self.append({"case": case, "passed": bool(ok), "detail": detail})

    def close(self, case: str, got: torch.Tensor, want: torch.Tensor) -> None:
        scale = want.abs().max().item()
        err = (got.detach().double().cpu() - want.detach()).abs().max().item()
        self.check(case, err <= REL * scale, f"max err {err:.3e} vs {REL} * {scale:.3e}")


def _local(full: torch.Tensor) -> torch.Tensor:
    rank, size = dist.get_rank(), full.shape[0] // TP
    return full[rank * size : (rank + 1) * size]


def _megatron_layout():
    """hidden ``[S, 1, H]`` (a fresh fp32 leaf), labels ``[1, S]``, upstream ``[1, S]``."""
    hidden = PROBLEM.hidden.float()[:, None, :].clone().requires_grad_()
    return hidden, PROBLEM.targets[None, :], PROBLEM.g_loss.float()[None, :]


def _column_layer(cls: Any, bias: bool) -> torch.nn.Module:
    from megatron.core import ModelParallelConfig

    config = ModelParallelConfig(
        tensor_model_parallel_size=TP, use_cpu_initialization=True, perform_initialization=False
    )
    layer = cls(16, 74, config=config, init_method=torch.nn.init.zeros_, bias=bias,
                gather_output=False)  # fmt: skip
    with torch.no_grad():
        layer.weight.copy_(_local(PROBLEM.weight))
        if bias:
            layer.bias.copy_(_local(PROBLEM.bias))
    return layer


def case_fused_map(rows: Rows) -> None:
    """The cap, scale and temperature through FusedOutputOptions on the fused path."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from lce.megatron import FusedOutputOptions, output_layer_logprobs, output_layer_loss

    options = FusedOutputOptions(backend="torch", **MAP)
    layer = _column_layer(ColumnParallelLinear, bias=False)
    hidden, labels, g = _megatron_layout()
    loss = output_layer_loss(hidden, layer, labels, options=options)
    (loss * g).sum().backward()
    ref = reference(PROBLEM, with_bias=False, **MAP)
    grad_hidden, grad_weight, _ = ref.grads((PROBLEM.g_loss * -ref.logprobs).sum())
    rows.close("fused-map loss", loss[0], -ref.logprobs)
    rows.close("fused-map grad_hidden", hidden.grad[:, 0], grad_hidden)
    rows.close("fused-map grad_weight", layer.weight.grad, _local(grad_weight))
    out = output_layer_logprobs(hidden.detach(), layer, labels, options=options)
    rows.close("fused-map logprobs", out.logprobs[0], ref.logprobs)
    rows.close("fused-map entropy", out.entropy[0], ref.entropy)
    _case_kept_logits(rows, layer, options)


def _case_kept_logits(rows: Rows, layer: torch.nn.Module, options: Any) -> None:
    """The per-token path with ``keep_logits_bytes``: its gradients, and the logits computed
    once (by the forward's keeping GEMM, none recomputed in backward)."""
    from lce.megatron import output_layer_logprobs
    from tests.helpers.logit_rows import logit_rows_computed

    kept = dataclasses.replace(options, keep_logits_bytes=1 << 30)
    hidden, labels, g = _megatron_layout()
    layer.weight.grad = None
    with logit_rows_computed() as computed:
        out = output_layer_logprobs(hidden, layer, labels, options=kept)
        (out.logprobs * g).sum().backward()
    ref = reference(PROBLEM, with_bias=False, **MAP)
    grad_hidden, grad_weight, _ = ref.grads((PROBLEM.g_loss * ref.logprobs).sum())
    rows.close("kept-logits logprobs", out.logprobs[0], ref.logprobs)
    rows.close("kept-logits grad_hidden", hidden.grad[:, 0], grad_hidden)
    rows.close("kept-logits grad_weight", layer.weight.grad, _local(grad_weight))
    tokens = labels.numel()
    rows.check("kept-logits computed once", computed == {"_logits": 0, "_kept_dots": tokens},
               f"rows of logits computed: {computed}, {tokens} tokens")  # fmt: skip


def case_fallback_applies_the_map(rows: Rows) -> None:
    """A biased layer falls back to the stock path, which must still apply the cap and scale."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from lce.megatron import FusedOutputOptions, output_layer_loss

    layer = _column_layer(ColumnParallelLinear, bias=True)
    hidden, labels, g = _megatron_layout()
    loss = output_layer_loss(hidden, layer, labels, options=FusedOutputOptions(**MAP))
    (loss * g).sum().backward()
    ref = reference(PROBLEM, with_bias=True, **MAP)
    grad_hidden = ref.grads((PROBLEM.g_loss * -ref.logprobs).sum())[0]
    valid = PROBLEM.targets != IGNORE  # the stock loss is meaningless there (masked by trainers)
    rows.close("fallback-map loss", loss[0][valid], -ref.logprobs[valid])
    rows.close("fallback-map grad_hidden", hidden.grad[:, 0], grad_hidden)


def case_mup_readout(rows: Rows) -> None:
    """An output layer with its own forward (a MuP readout's multiplier): not fused, and the
    stock path's result is the layer's own."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy

    from lce.megatron import output_layer_loss

    class MuPReadout(ColumnParallelLinear):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            logits, bias = super().forward(*args, **kwargs)
            return logits * MUP_MULTIPLIER, bias

    layer = _column_layer(MuPReadout, bias=False)
    hidden, labels, _ = _megatron_layout()
    loss = output_layer_loss(hidden, layer, labels)
    ref = reference(PROBLEM, with_bias=False, logit_scale=MUP_MULTIPLIER)
    valid = PROBLEM.targets != IGNORE
    rows.close("mup-readout loss", loss[0][valid], -ref.logprobs[valid])
    stock = vocab_parallel_cross_entropy(layer(hidden)[0].float(), labels.T.clamp(min=0))
    rows.check("mup-readout", torch.equal(loss[0][valid], stock.T[0][valid]), "the stock loss")


def _gpt_model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, tensor_model_parallel_size=TP,
        use_cpu_initialization=True, perform_initialization=False, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32,
    )  # fmt: skip
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=74, max_sequence_length=12)
    with torch.no_grad():
        model.output_layer.weight.copy_(_local(PROBLEM.weight))
    return model


def case_loss_override(rows: Rows) -> None:
    """A trainer's own compute_language_model_loss (here a final-logit softcap, as Gemma ports
    add one) is not bypassed: the patched model falls back to it."""
    from lce.megatron import patch_gpt_model

    model = _gpt_model()
    stock_loss = type(model).compute_language_model_loss

    def capped(self: Any, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return stock_loss(self, labels, 5.0 * torch.tanh(logits / 5.0))

    model.compute_language_model_loss = types.MethodType(capped, model)
    hidden, labels, _ = _megatron_layout()

    def postprocess() -> Any:
        ids = torch.zeros(1, 12, dtype=torch.long)
        return model._postprocess(
            hidden_states=hidden, input_ids=ids, position_ids=ids, labels=labels.clamp(min=0),
            rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
        )  # fmt: skip

    want = postprocess()
    with patch_gpt_model(model):
        got = postprocess()
    rows.check("loss-override", torch.equal(got, want), "the override's loss, not lce's")
    ref = reference(PROBLEM, with_bias=False, softcap=5.0)
    valid = PROBLEM.targets != IGNORE
    rows.close("loss-override capped", got[0][valid], -ref.logprobs[valid])
    try:
        with patch_gpt_model(model, returns="logprobs"):
            postprocess()
        rows.check("loss-override logprobs", False, "returns='logprobs' must raise")
    except ValueError as error:
        rows.check(
            "loss-override logprobs", "compute_language_model_loss" in str(error), str(error)
        )


def worker(rank: int, workdir: str) -> None:
    from megatron.core import parallel_state

    from lce.megatron import LCEFallbackWarning

    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=TP,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    rows = Rows()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for case in (case_fused_map, case_fallback_applies_the_map, case_mup_readout,
                     case_loss_override):  # fmt: skip
            case(rows)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, LCEFallbackWarning)]
    for reason in ("bias", "MuPReadout.forward", "compute_language_model_loss override"):
        named = [m for m in fallbacks if reason in m]
        rows.check(f"warning {reason}", len(named) == 1, f"once, naming it: {fallbacks}")
    rows.check("warnings", len(fallbacks) == 3, f"no other fallback: {fallbacks}")
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(rows))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
