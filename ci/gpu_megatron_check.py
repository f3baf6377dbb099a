"""lce.megatron vs megatron-core's stock LM head on real megatron-core objects, TP = 1 and TP = k.

Runs every case of the CPU test (tests/lce/test_megatron.py imports `run`) on one spawned world:
CUDA + NCCL when GPUs are present (use ``--backend triton``), else CPU + gloo. Three actors per
output, as in the tolerance model: K = lce.megatron, B = megatron-core's stock path
(ColumnParallelLinear + vocab_parallel_cross_entropy, same dtype), R = float64 materialized.
Tolerances are tolerances.yaml's (their reasons are there): K passes the ratio tier against B and
the envelope against R; where no stock peer exists (entropy via the patch, the fallback itself,
which *is* the stock path) only the envelope against R applies.

    python ci/gpu_megatron_check.py --nprocs 2 --backend triton      # 1 or 2 GPUs
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import warnings
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (and in its spawned ranks): import lce, verify
    sys.path.insert(0, str(ROOT))
from verify.cases.build import build  # noqa: E402 (after the path set-up above)
from verify.cases.spec import CaseSpec  # noqa: E402
from verify.numerics.reference import IGNORE_INDEX  # noqa: E402

SEED = 20261122
S, B, H, V = 8, 2, 24, 74  # S divisible by TP=2; V / 2 = 37 rows per rank, odd on purpose


@dataclass(frozen=True)
class Problem:
    """One case's numbers in megatron's layout, float64, identical at every TP."""

    hidden: torch.Tensor  # [S, B, H]
    weight: torch.Tensor  # [V, H]
    labels: torch.Tensor  # [B, S] global ids (ignore_index where `ignore` was asked)
    g_loss: torch.Tensor  # [B, S] upstream gradients: random, non-uniform, signed
    g_logprob: torch.Tensor
    g_entropy: torch.Tensor


def megatron_problem(seed: int, ignore: bool) -> Problem:
    """The harness's problem of a `CaseSpec` (``[B, S]`` tokens, log-normal weight rows, logits of
    scale 3, random ignored tokens when ``ignore``), with hidden as megatron's ``[S, B, H]``."""
    spec = CaseSpec(
        tokens=S, batch=B, hidden_size=H, vocab=V, hidden_dtype="fp64", weight_dtype="fp64",
        scale=3.0, ignore="random" if ignore else "none", reduction="none", seed=seed,
    )  # fmt: skip
    problem = build(spec)
    # The loss's upstream: the case's second, independent upstream draw.
    g_loss = build(spec.with_(transform="upstream_b")).grad_logprob
    return Problem(
        problem.hidden.view(B, S, H).transpose(0, 1).contiguous(), problem.weight,
        problem.targets.view(B, S), g_loss.double().view(B, S),
        problem.grad_logprob.double().view(B, S), problem.grad_entropy.double().view(B, S),
    )  # fmt: skip


@dataclass
class Ctx:
    """Where a case runs and where its verdicts go."""

    tp: int
    rank: int  # rank inside the TP group
    device: torch.device
    backend: str
    rows: list[dict]

    def local_rows(self, full: torch.Tensor) -> torch.Tensor:
        size = full.shape[0] // self.tp
        return full[self.rank * size : (self.rank + 1) * size]

    def record(self, case: str, verdict: object) -> None:
        out = {"output": verdict.output, "passed": verdict.passed, "detail": verdict.detail}  # type: ignore[attr-defined]
        self.rows.append({"tp": self.tp, "case": case, **out})

    def check(self, case: str, ok: bool, detail: str) -> None:
        self.rows.append(check_row(self.tp, case, ok, detail))


def check_row(tp: int, case: str, ok: bool, detail: str) -> dict:
    """A row for a yes/no check, shaped like a `Verdict` row."""
    return {"tp": tp, "case": case, "output": "check", "passed": ok, "detail": detail}


def layer_bias() -> torch.Tensor:
    """The output-layer bias of the fallback case, global ``[V]``: spread, not constant."""
    return torch.linspace(-2.0, 3.0, V, dtype=torch.float64)


def _leaf(x: torch.Tensor, dtype: torch.dtype, ctx: Ctx) -> torch.Tensor:
    return x.to(dtype).to(ctx.device).requires_grad_()


def _column_layer(ctx: Ctx, wdtype: torch.dtype, sp: bool, bias: bool, shard: torch.Tensor):
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    config = ModelParallelConfig(
        tensor_model_parallel_size=ctx.tp, sequence_parallel=sp, use_cpu_initialization=True,
        perform_initialization=False, params_dtype=wdtype,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sequence_parallel with TP=1 disabled": expected
        layer = ColumnParallelLinear(
            H, V, config=config, init_method=torch.nn.init.zeros_, bias=bias, gather_output=False
        )
    with torch.no_grad():
        layer.weight.copy_(shard.to(wdtype))
        if bias:
            layer.bias.copy_(ctx.local_rows(layer_bias()))
    return layer.to(ctx.device)


def _stock_loss(hidden: torch.Tensor, layer, labels: torch.Tensor) -> torch.Tensor:
    """GPTModel's stock path: the layer's logits, then vocab_parallel_cross_entropy, [B, S]."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits, _ = layer(hidden)
    return vocab_parallel_cross_entropy(logits, labels.T.contiguous()).T


def _grads(layer, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = hidden.grad.detach().clone(), layer.weight.grad.detach().clone()
    hidden.grad = None
    layer.weight.grad = None
    return out


def _token_reference(prob: Problem, hdtype, wdtype, temperature: float, loss: bool):
    """R on the same rounded inputs; upstream grads of the loss or of (logprobs, entropy)."""
    from lce.options import LogitOptions
    from verify.numerics.reference import Upstream, reference

    upstream = (
        Upstream(loss=prob.g_loss.T.reshape(-1))
        if loss
        else Upstream(prob.g_logprob.T.reshape(-1), prob.g_entropy.T.reshape(-1))
    )
    return reference(
        prob.hidden.to(hdtype).reshape(-1, H), prob.weight.to(wdtype), prob.labels.T.reshape(-1),
        options=LogitOptions(temperature=temperature), upstream=upstream,
    )  # fmt: skip


def _verdicts(ctx: Ctx, case: str, key: str, triples) -> None:
    """compare() each (output, K, R, B) under tolerances.yaml[key][output]."""
    from verify.numerics.compare import compare
    from verify.numerics.tolerances import load

    for output, kernel, ref, base in triples:
        # A tied embedding's gradient is a weight gradient (a sum over tokens): same entry.
        tol = load().get(key, "grad_weight" if output == "grad_embedding" else output)
        base = None if base is None else base.detach().cpu()
        ctx.record(case, compare(output, kernel.detach().cpu(), ref, base, tol))


def case_loss(ctx: Ctx, prob: Problem, hdtype, wdtype, sp: bool) -> None:
    """SFT: output_layer_loss vs ColumnParallelLinear + vocab_parallel_cross_entropy."""
    from lce.megatron import FusedOutputOptions, output_layer_loss
    from verify.numerics.tolerances import dtype_key

    layer = _column_layer(ctx, wdtype, sp, False, ctx.local_rows(prob.weight))
    hidden = ctx.local_rows(prob.hidden) if sp else prob.hidden
    labels, g = prob.labels.to(ctx.device), prob.g_loss.to(ctx.device)
    h_k = _leaf(hidden, hdtype, ctx)
    loss_k = output_layer_loss(h_k, layer, labels, options=FusedOutputOptions(backend=ctx.backend))
    (loss_k * g).sum().backward()
    gh_k, gw_k = _grads(layer, h_k)
    # B runs in the weight's dtype: the stock layer cannot mix dtypes, a user casts hidden first.
    h_b = _leaf(hidden, wdtype, ctx)
    loss_b = _stock_loss(h_b, layer, labels)
    (loss_b * g).sum().backward()
    gh_b, gw_b = _grads(layer, h_b)
    ref = _token_reference(prob, hdtype, wdtype, 1.0, loss=True)
    r_gh = ref.grad_hidden.view(S, B, H)
    name = f"loss/{dtype_key(hdtype, wdtype)}/sp={int(sp)}"
    _verdicts(ctx, name, dtype_key(hdtype, wdtype), [
        ("loss", loss_k, (-ref.logprobs).view(S, B).T, loss_b),
        ("grad_hidden", gh_k, ctx.local_rows(r_gh) if sp else r_gh, gh_b),
        ("grad_weight", gw_k, ctx.local_rows(ref.grad_weight), gw_b),
    ])  # fmt: skip
    ctx.check(name, gh_k.dtype == hdtype, f"grad_hidden dtype {gh_k.dtype} == hidden's {hdtype}")


def case_main_grad(ctx: Ctx, prob: Problem, hdtype, wdtype, sp: bool, upstream: str) -> None:
    """gradient_accumulation_fusion: the loss adds grad_weight into weight.main_grad (3 GEMMs).

    Megatron's DDP gives each parameter an fp32 ``main_grad`` and ``grad_added_to_main_grad =
    False``; both are set here as its constructor does (its buffers need CUDA). ``upstream``:
    ``assumed`` (1 per token, the forward's assumption) or ``random`` (every row recomputed).
    """
    from lce.megatron import FusedOutputOptions, output_layer_loss
    from verify.numerics.tolerances import dtype_key

    if upstream == "assumed":
        prob = replace(prob, g_loss=torch.ones_like(prob.g_loss))
    layer = _column_layer(ctx, wdtype, sp, False, ctx.local_rows(prob.weight))
    hidden = ctx.local_rows(prob.hidden) if sp else prob.hidden
    labels, g = prob.labels.to(ctx.device), prob.g_loss.to(ctx.device)
    ref = _token_reference(prob, hdtype, wdtype, 1.0, loss=True)
    ref_gw = ctx.local_rows(ref.grad_weight)
    gen = torch.Generator("cpu").manual_seed(SEED + 11)
    # Old content at the gradient's scale, as after earlier micro-batches.
    old = torch.randn(ref_gw.shape, generator=gen, dtype=torch.float64) * ref_gw.abs().max()
    old = old.float().to(ctx.device)
    h_b = _leaf(hidden, wdtype, ctx)  # B: the stock layer, without the fusion (needs APEX)
    (_stock_loss(h_b, layer, labels) * g).sum().backward()
    gh_b, gw_b = _grads(layer, h_b)
    # The stock layer refuses the flag at construction without APEX's fused wgrad kernels.
    layer.gradient_accumulation_fusion = True
    layer.weight.main_grad = old.clone()
    layer.weight.grad_added_to_main_grad = False
    h_k = _leaf(hidden, hdtype, ctx)
    loss_k = output_layer_loss(h_k, layer, labels, options=FusedOutputOptions(backend=ctx.backend))
    (loss_k * g).sum().backward()
    r_gh = ref.grad_hidden.view(S, B, H)
    key = dtype_key(hdtype, wdtype)
    name = f"main-grad/{key}/sp={int(sp)}/{upstream}"
    _verdicts(ctx, name, key, [
        ("loss", loss_k, (-ref.logprobs).view(S, B).T, None),
        ("grad_hidden", h_k.grad, ctx.local_rows(r_gh) if sp else r_gh, gh_b),
        ("grad_weight", layer.weight.main_grad - old, ref_gw, gw_b),
    ])  # fmt: skip
    dummy = layer.weight.grad
    ok = layer.weight.grad_added_to_main_grad is True and dummy.shape == layer.weight.shape
    ctx.check(name, ok, "weight.grad is megatron's dummy, grad_added_to_main_grad set")


def case_logprobs(ctx: Ctx, prob: Problem, hdtype, wdtype, sp: bool) -> None:
    """RL: output_layer_logprobs (logprobs, entropy, T=0.7, ignored labels) vs the stock path."""
    from lce.megatron import FusedOutputOptions, output_layer_logprobs
    from lce.megatron.head import tp_group_of
    from lce.megatron.stock import stock_logits, stock_token_outputs
    from verify.numerics.tolerances import dtype_key

    temperature = 0.7
    layer = _column_layer(ctx, wdtype, sp, False, ctx.local_rows(prob.weight))
    hidden = ctx.local_rows(prob.hidden) if sp else prob.hidden
    labels = prob.labels.to(ctx.device)
    g_lp, g_ent = prob.g_logprob.to(ctx.device), prob.g_entropy.to(ctx.device)
    options = FusedOutputOptions(temperature=temperature, backend=ctx.backend)
    h_k = _leaf(hidden, hdtype, ctx)
    out_k = output_layer_logprobs(h_k, layer, labels, options=options)
    (out_k.logprobs * g_lp + out_k.entropy * g_ent).sum().backward()
    gh_k, gw_k = _grads(layer, h_k)
    h_b = _leaf(hidden, wdtype, ctx)
    logits = stock_logits(h_b, layer, None, temperature)
    lp_b, ent_b = stock_token_outputs(logits, labels.T, tp_group_of(layer), IGNORE_INDEX, True)
    (lp_b.T * g_lp + ent_b.T * g_ent).sum().backward()
    gh_b, gw_b = _grads(layer, h_b)
    ref = _token_reference(prob, hdtype, wdtype, temperature, loss=False)
    r_gh = ref.grad_hidden.view(S, B, H)
    key = dtype_key(hdtype, wdtype)
    r_outputs = [
        ("logprobs", ref.logprobs.view(S, B).T),
        ("entropy", ref.entropy.view(S, B).T),
        ("grad_hidden", ctx.local_rows(r_gh) if sp else r_gh),
        ("grad_weight", ctx.local_rows(ref.grad_weight)),
    ]
    kernel, stock = (out_k.logprobs, out_k.entropy, gh_k, gw_k), (lp_b.T, ent_b.T, gh_b, gw_b)
    name = f"logprobs/{key}/sp={int(sp)}"
    triples = zip(r_outputs, kernel, stock, strict=True)
    _verdicts(ctx, name, key, [(o, k, r, b) for (o, r), k, b in triples])
    # The fallback (stock) path must itself be right: envelope tier against R.
    fallback = [(o, b, r, None) for (o, r), b in zip(r_outputs, stock, strict=True)]
    _verdicts(ctx, f"stock-fallback/{key}", key, fallback)
    ignored = prob.labels.to(ctx.device) == IGNORE_INDEX
    zero = bool((out_k.logprobs[ignored] == 0).all() and (out_k.entropy[ignored] == 0).all())
    ctx.check(name, zero and bool(ignored.any()), "ignored labels give exactly 0")


class Wrapped(torch.nn.Module):
    """Holds a model as ``.module``, like megatron's DDP and Float16Module."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def _tied_model(ctx: Ctx, prob: Problem, positions: torch.Tensor):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=2, tensor_model_parallel_size=ctx.tp,
        use_cpu_initialization=True, perform_initialization=False, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Apex is not installed": the local spec uses torch norms
        model = GPTModel(
            config, get_gpt_layer_local_spec(), vocab_size=V, max_sequence_length=S,
            share_embeddings_and_output_weights=True,
        )  # fmt: skip
    with torch.no_grad():
        model.embedding.word_embeddings.weight.copy_(ctx.local_rows(prob.weight))
        model.embedding.position_embeddings.weight.copy_(positions)
    return model.to(ctx.device)


def _tied_reference(prob: Problem, ids: torch.Tensor, positions: torch.Tensor, entropy: bool):
    """R for a tied GPT head: float64 autograd through the lookup and the LM head. Objective:
    ``sum(g_loss * loss)``, plus ``sum(g_entropy * entropy)`` when ``entropy``."""
    weight = prob.weight.float().double().requires_grad_()  # the model's fp32 rounding
    hidden = (
        weight[ids.T] + positions.float().double()[:, None, :]
    )  # [S, B, H]: word + learned position
    logp = torch.log_softmax(hidden @ weight.T, dim=-1)
    loss = -logp.gather(-1, prob.labels.T[..., None]).squeeze(-1).T  # [B, S]
    ent = -(logp.exp() * logp).sum(-1).T
    objective = (loss * prob.g_loss).sum() + (ent * prob.g_entropy).sum() * entropy
    objective.backward()
    return loss.detach(), ent.detach(), weight.grad


def case_tied_gpt(ctx: Ctx, prob: Problem) -> None:
    """A real GPTModel with tied embeddings: patched vs stock _postprocess, through the lookup."""
    from lce.megatron import FusedOutputOptions, patch_gpt_model

    gen = torch.Generator("cpu").manual_seed(SEED + 7)
    positions = torch.randn(S, H, generator=gen, dtype=torch.float64) * 0.5
    ids = torch.randint(0, V, (B, S), generator=gen)
    model = _tied_model(ctx, prob, positions.float())
    embed = model.embedding.word_embeddings.weight
    ids_d, labels = ids.to(ctx.device), prob.labels.to(ctx.device)
    g, g_ent = prob.g_loss.to(ctx.device), prob.g_entropy.to(ctx.device)
    pos = torch.arange(S, device=ctx.device).expand(B, S)

    def postprocess(labels: torch.Tensor | None):
        model.zero_grad(set_to_none=True)
        hidden = model.embedding(input_ids=ids_d, position_ids=pos)
        return model._postprocess(
            hidden_states=hidden, input_ids=ids_d, position_ids=pos, labels=labels,
            rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
        )  # fmt: skip

    def loss_and_grad() -> tuple[torch.Tensor, torch.Tensor]:
        loss = postprocess(labels)
        (loss * g).sum().backward()
        return loss.detach(), embed.grad.detach().clone()

    loss_b, grad_b = loss_and_grad()
    options = FusedOutputOptions(backend=ctx.backend)
    with patch_gpt_model(model, options=options):
        loss_k, grad_k = loss_and_grad()
        logits = postprocess(None)
    ctx.check("tied-gpt", tuple(logits.shape) == (B, S, V // ctx.tp), "no labels: stock logits")
    ctx.check("tied-gpt", "_postprocess" not in model.__dict__, "remove() restores the model")
    loss_r, _, grad_r = _tied_reference(prob, ids, positions, entropy=False)
    _verdicts(ctx, "tied-gpt/fp32", "fp32", [
        ("loss", loss_k, loss_r, loss_b),
        ("grad_embedding", grad_k, ctx.local_rows(grad_r), grad_b),
    ])  # fmt: skip
    # Through a wrapper with `.module`, as DDP / Float16Module hold the GPTModel.
    with patch_gpt_model(Wrapped(model), returns="logprobs", options=options):
        out = postprocess(labels)
        (-out.logprobs * g + out.entropy * g_ent).sum().backward()
    loss_r, ent_r, grad_r = _tied_reference(prob, ids, positions, entropy=True)
    _verdicts(ctx, "tied-gpt-logprobs/fp32", "fp32", [
        ("logprobs", out.logprobs, -loss_r, -loss_b),
        ("entropy", out.entropy, ent_r, None),
        ("grad_embedding", embed.grad, ctx.local_rows(grad_r), None),
    ])  # fmt: skip
    _check_missing_weight_error(ctx, model.output_layer)


def _check_missing_weight_error(ctx: Ctx, output_layer) -> None:
    """A tied head has no weight of its own: calling it without ``weight=`` must say so."""
    from lce.megatron import output_layer_loss

    hidden = torch.zeros(S, B, H, device=ctx.device)
    labels = torch.zeros(B, S, dtype=torch.long, device=ctx.device)
    try:
        output_layer_loss(hidden, output_layer, labels)
        ctx.check("tied-gpt", False, "weight=None with output_layer.weight None must raise")
    except ValueError as error:
        ctx.check("tied-gpt", "shared_embedding_or_output_weight" in str(error), str(error))


def case_fallback_bias(ctx: Ctx, prob: Problem) -> None:
    """An output-layer bias is not fused: the stock path runs (and is right) after one warning."""
    from lce.megatron import FusedOutputOptions, output_layer_loss

    layer = _column_layer(ctx, torch.float32, False, True, ctx.local_rows(prob.weight))
    options = FusedOutputOptions(backend=ctx.backend)
    labels, g = prob.labels.to(ctx.device), prob.g_loss.to(ctx.device)
    for _ in range(2):  # the second call must not warn again (checked by the worker)
        hidden = _leaf(prob.hidden, torch.float32, ctx)
        loss = output_layer_loss(hidden, layer, labels, options=options)
    (loss * g).sum().backward()
    grad_hidden, grad_weight = _grads(layer, hidden)
    # R: float64 autograd of the biased head on the same fp32-rounded inputs.
    h64 = prob.hidden.float().double().requires_grad_()
    w64 = prob.weight.float().double().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.T + layer_bias(), dim=-1)
    ref = -logp.gather(-1, prob.labels.T[..., None]).squeeze(-1).T
    (ref * prob.g_loss).sum().backward()
    _verdicts(ctx, "fallback-bias", "fp32", [
        ("loss", loss, ref.detach(), None),
        ("grad_hidden", grad_hidden, h64.grad, None),
        ("grad_weight", grad_weight, ctx.local_rows(w64.grad), None),
    ])  # fmt: skip


def case_frozen_head(ctx: Ctx, prob: Problem) -> None:
    """A frozen LM head (e.g. adapters-only RL): the stock layer takes its frozen-weight path."""
    from lce.megatron import FusedOutputOptions, output_layer_loss

    sp = ctx.tp > 1
    layer = _column_layer(ctx, torch.float32, sp, False, ctx.local_rows(prob.weight))
    layer.weight.requires_grad_(False)
    hidden = ctx.local_rows(prob.hidden) if sp else prob.hidden
    labels, g = prob.labels.to(ctx.device), prob.g_loss.to(ctx.device)
    h_k, h_b = _leaf(hidden, torch.float32, ctx), _leaf(hidden, torch.float32, ctx)
    loss_k = output_layer_loss(h_k, layer, labels, options=FusedOutputOptions(backend=ctx.backend))
    (loss_k * g).sum().backward()
    loss_b = _stock_loss(h_b, layer, labels)
    (loss_b * g).sum().backward()
    ref = _token_reference(prob, torch.float32, torch.float32, 1.0, loss=True)
    r_gh = ref.grad_hidden.view(S, B, H)
    name = f"frozen-head/fp32/sp={int(sp)}"
    _verdicts(ctx, name, "fp32", [
        ("loss", loss_k, (-ref.logprobs).view(S, B).T, loss_b),
        ("grad_hidden", h_k.grad, ctx.local_rows(r_gh) if sp else r_gh, h_b.grad),
    ])  # fmt: skip
    ctx.check(name, layer.weight.grad is None, "a frozen head gets no gradient")


def run_cases(ctx: Ctx) -> None:
    fp32, bf16 = torch.float32, torch.bfloat16
    plain, with_ignored = (
        megatron_problem(SEED, ignore=False),
        megatron_problem(SEED + 1, ignore=True),
    )
    for hdtype, wdtype in ((fp32, fp32), (bf16, bf16), (fp32, bf16)):
        for sp in (False, True) if ctx.tp > 1 else (False,):  # megatron: SP needs TP > 1
            case_loss(ctx, plain, hdtype, wdtype, sp)
            case_logprobs(ctx, with_ignored, hdtype, wdtype, sp)
            for upstream in ("assumed", "random"):
                case_main_grad(ctx, with_ignored, hdtype, wdtype, sp, upstream)
    case_frozen_head(ctx, plain)
    case_tied_gpt(ctx, plain)
    case_fallback_bias(ctx, plain)


def _cpu_shim() -> None:
    # megatron-core allocates its sequence-parallel gather/reduce-scatter buffers on
    # torch.cuda.current_device(); on a CPU-only run, point that at the CPU so it runs on gloo.
    torch.cuda.current_device = lambda: torch.device("cpu")


def worker(rank: int, world: int, workdir: str, backend: str) -> None:
    from megatron.core import parallel_state

    from lce.megatron import LCEFallbackWarning

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        _cpu_shim()
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{workdir}/store", rank=rank,
        world_size=world, timeout=timedelta(seconds=120),
    )  # fmt: skip
    rows: list[dict] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tp in sorted({1, world}):
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
            device = torch.device("cuda", rank) if cuda else torch.device("cpu")
            rank_in_tp = parallel_state.get_tensor_model_parallel_rank()
            run_cases(Ctx(tp, rank_in_tp, device, backend, rows))
            parallel_state.destroy_model_parallel()
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, LCEFallbackWarning)]
    ok = len(fallbacks) == 1 and "bias" in fallbacks[0]
    detail = f"one warning, naming the bias, over all fallback calls: {fallbacks}"
    rows.append(check_row(world, "fallback-warning", ok, detail))
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def run(nprocs: int, backend: str, workdir: Path) -> list[dict]:
    """Spawn one world of ``nprocs`` ranks, run every case at TP=1 and TP=nprocs, return rows."""
    mp.spawn(worker, args=(nprocs, str(workdir), backend), nprocs=nprocs, join=True)
    files = [Path(workdir, f"rank{rank}.json") for rank in range(nprocs)]
    return [row for file in files for row in json.loads(file.read_text())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, choices=(1, 2))
    parser.add_argument("--backend", default="triton" if torch.cuda.is_available() else "torch")
    parser.add_argument("--json", type=Path, help="also write every verdict here")
    args = parser.parse_args()
    if importlib.util.find_spec("megatron") is None:  # else each spawned rank fails at import
        print("megatron-core is not installed: install (or carry) megatron-core 0.16.1 first")
        return 2
    with tempfile.TemporaryDirectory() as workdir:
        rows = run(args.nprocs, args.backend, Path(workdir))
    for row in rows:
        status = "ok  " if row["passed"] else "FAIL"
        print(f"{status} tp={row['tp']} {row['case']:<28} {row['output']:<14} {row['detail']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    failed = [row for row in rows if not row["passed"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} passed, backend={args.backend} x{args.nprocs}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
