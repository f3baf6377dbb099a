"""Built-in adapters: lce (both backends; the engine runs lce through it), torch's
linear_cross_entropy, Liger (its Triton kernel and its Hopper CuTe DSL kernels), cut-cross-entropy
(its kernel and its torch.compile path), QuACK, verl's fused kernel.

Each factory returns an `Adapter` or raises `AdapterError` saying what is missing (a package, a
torch version, a CUDA device). Third-party packages are imported only when their adapter is asked
for.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from dataclasses import fields, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import lce
from lce.validation import HOST_CHECKS_ENV
from verify.adapters import verl_kernel
from verify.adapters.interface import (
    DEFAULT_PAIRS,
    Adapter,
    AdapterError,
    Call,
    Capabilities,
    Limits,
    NumericalContract,
)
from verify.cases.spec import BACKENDS, DTENSOR_LAYOUTS, LOSS_OPTIONS, LOSS_PATHS, OPTION_FIELDS

# What lce raises on an input it refuses; any other exception is a bug (it propagates).
LCE_REFUSALS = (ValueError, TypeError, IndexError, RuntimeError)
# The harness judges lce's named errors on bad targets (the status property) and any upstream
# on main_grad: on CUDA lce checks those values with device-side asserts unless its host checks
# are on (a failed assert would leave the worker's CUDA context unusable, a crash to the harness).
os.environ.setdefault(HOST_CHECKS_ENV, "1")


def _lce_tokens(call: Call) -> dict[str, torch.Tensor]:
    kwargs = {k: v for k, v in _lce_kwargs(call).items() if k not in LOSS_OPTIONS}
    out = lce.token_logprobs(call.hidden, call.weight, call.targets, **kwargs)
    return {"logprobs": out.logprobs, "entropy": out.entropy}


def _lce_loss(call: Call, reduction: str) -> torch.Tensor:
    kwargs = _lce_kwargs(call)
    weight = call.weight
    if call.loss_path == "fast":
        kwargs["fast"] = True
    elif call.loss_path == "main_grad" and weight.requires_grad and torch.is_grad_enabled():
        weight, kwargs["grad_weight_into"] = main_grad_weight(weight)
        kwargs["assumed_loss_grad"] = MAIN_GRAD_ASSUMED_LOSS_GRAD
    return lce.linear_cross_entropy(
        call.hidden, weight, call.targets, reduction=reduction, **kwargs
    )


# The upstream gradient the main_grad path tells lce to assume: its forward accumulates the
# weight gradient for it; backward undoes and redoes the rows whose upstream differs.
MAIN_GRAD_ASSUMED_LOSS_GRAD = 1.0


def main_grad_old_content(weight: torch.Tensor) -> torch.Tensor:
    """What `main_grad_weight` puts in main_grad before the call, on the CPU: random at
    ``weight``'s scale, a function of ``weight`` alone (its size seeds it), in main_grad's dtype
    (fp64 for fp64 weights, else fp32)."""
    gen = torch.Generator().manual_seed(weight.numel())
    scale = weight.detach().abs().amax().item() if weight.numel() else 1.0  # empty shards too
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    return (torch.randn(weight.shape, generator=gen) * scale).to(acc)


def main_grad_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` as Megatron's DDP presents it to a fused layer, and its main_grad.

    main_grad starts with old content (`main_grad_old_content`), the returned view carries
    DDP's flags with ``zero_out_wgrad`` (lce then returns a zero dummy gradient), and its backward
    hands ``weight`` what main_grad gained since the last backward, as DDP's hook would add a
    real ``.grad``: the engine's gradient checks then judge what main_grad received.
    """
    main_grad = main_grad_old_content(weight).to(weight.device)
    view = _MainGradView.apply(weight, main_grad)
    view.grad_added_to_main_grad = False
    view.zero_out_wgrad = True
    return view, main_grad


class _MainGradView(torch.autograd.Function):
    """Identity on the weight; backward adds what ``main_grad`` gained since the last backward."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
        ctx.main_grad, ctx.seen = main_grad, main_grad.clone()
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        gained = ctx.main_grad - ctx.seen
        ctx.seen = ctx.main_grad.clone()
        return grad + gained.to(grad.dtype), None


def _lce_kwargs(call: Call) -> dict:
    """lce's keyword arguments of ``call``: every field of its options record, and the bias.

    The record's fields are read one by one, not with ``dataclasses.asdict``: the compiled
    property traces this under ``torch.compile(fullgraph=True)``, and asdict's ``copy.deepcopy``
    of each value is a graph break Dynamo before torch 2.13 does not trace."""
    options = {f.name: getattr(call.options, f.name) for f in fields(call.options)}
    kept = _kept_logits_budget(call) if call.loss_path == "kept_logits" else 0
    return {
        **options, "bias": call.bias, "ignore_index": call.ignore_index,
        "tp_group": call.tp_group, "vocab_start": call.vocab_start, "backend": call.backend,
        "chunk_size": call.chunk_size, "reduce_grad_hidden": call.reduce_grad_hidden,
        "keep_logits_bytes": kept,
    }  # fmt: skip


def _kept_logits_budget(call: Call) -> int:
    """The ``kept_logits`` path's ``keep_logits_bytes``: exactly this rank's ``[T, V_local]``
    logits (the boundary: a byte less keeps none; at least 1, since 0 keeps none at all)."""
    weight = call.weight
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return max(1, call.targets.numel() * local.shape[0] * local.element_size())


def lce_adapter(backends: tuple[str, ...] = BACKENDS) -> Adapter:
    """lce itself; ``Call.backend`` picks the backend among ``backends``."""
    caps = Capabilities(
        options=OPTION_FIELDS, tensor_parallel=True, chunk_size=True, backends=backends,
        deterministic=True, validates_inputs=True, loss_paths=LOSS_PATHS,
        double_backward=("torch",), compiles=backends, graph_capture=backends,
        dtensor_weights=DTENSOR_LAYOUTS[1:],
    )  # fmt: skip
    name = "lce" if len(backends) > 1 else f"lce-{backends[0]}"
    return Adapter(
        name, ("logprobs", "entropy", "loss"), _lce_tokens, _lce_loss, caps,
        description=f"lce.token_logprobs / lce.linear_cross_entropy, backends {list(backends)}",
        refusals=LCE_REFUSALS,
    )  # fmt: skip


def flat_loss_adapter(
    name: str, loss_2d: Callable[[Call, str], torch.Tensor], **fields: Any
) -> Adapter:
    """An adapter for a loss of 2-D inputs, ``loss_2d(call, reduction)`` with ``call.hidden``
    ``[N, H]`` cast to weight's dtype (as a linear layer does) and ``call.targets`` ``[N]`` (3-D
    inputs flattened); log-probs come from ``-loss(reduction='none')`` where the capabilities
    claim that reduction, else the adapter computes the loss only."""

    def loss(call: Call, reduction: str) -> torch.Tensor:
        out = loss_2d(flattened(call), reduction)
        return out.view(call.targets.shape) if reduction == "none" else out

    def tokens(call: Call) -> dict[str, torch.Tensor]:
        plain = replace(call, options=replace(call.options, z_loss=0.0, label_smoothing=0.0))
        return {"logprobs": -loss(plain, "none")}

    caps = fields.get("capabilities", Capabilities())
    if "none" not in caps.reductions:  # a kernel of the reduced loss only
        return Adapter(name, ("loss",), None, loss, **fields)
    return Adapter(name, ("logprobs", "loss"), tokens, loss, **fields)


def flattened(call: Call) -> Call:
    """``call`` with ``hidden`` ``[N, H]`` in weight's dtype (as a linear layer casts it) and
    ``targets`` ``[N]``: 3-D inputs flattened, for kernels of 2-D inputs."""
    hidden = call.hidden.to(call.weight.dtype).reshape(-1, call.hidden.shape[-1])
    return replace(call, hidden=hidden, targets=call.targets.reshape(-1))


def torch_adapter() -> Adapter:
    """``torch.nn.functional.linear_cross_entropy`` (PyTorch >= 2.13), its reference path: bias
    (``linear_bias``) and label smoothing."""
    if not hasattr(F, "linear_cross_entropy"):
        raise AdapterError(f"torch {torch.__version__} has no F.linear_cross_entropy; need >= 2.13")

    def loss_2d(call: Call, reduction: str) -> torch.Tensor:
        return F.linear_cross_entropy(
            call.hidden, call.weight, call.targets, linear_bias=call.bias, reduction=reduction,
            ignore_index=call.ignore_index, label_smoothing=call.options.label_smoothing,
        )  # fmt: skip

    return flat_loss_adapter(
        "torch", loss_2d, contract=NumericalContract(logits="input", outputs="input"),
        # A PyTorch function, traced by Dynamo like any: the compiled property holds it to its
        # eager run (passed on the CPU with aot_eager, torch 2.13).
        capabilities=Capabilities(options=("bias", "label_smoothing"), compiles=("torch",)),
        description="torch.nn.functional.linear_cross_entropy (options=None)",
        skip=(("torch_peer", "the torch peer is this implementation: it would judge itself"),),
    )  # fmt: skip


def _import(module: str, package: str) -> object:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise AdapterError(f"{package} is not installed ({exc}); `pip install {package}`") from exc


def _need_cuda(name: str) -> None:
    if not torch.cuda.is_available():
        raise AdapterError(f"adapter {name!r} runs Triton kernels on CUDA; no CUDA device here")


# Why the compiled property does not test a peer: each was run under it on an H100 (torch 2.11,
# 2026-11-25) and fails at the first example, whatever the case; claiming it would spend the
# adapters step on that one finding (docs/adapters-gpu.md).
NO_FULLGRAPH = {
    "liger": "torch.compile(fullgraph=True) fails (liger-kernel 0.8.5, torch 2.11): Dynamo cannot "
    "trace hasattr() on its autograd.Function (docs/adapters-gpu.md)",
    "cce": "torch.compile(fullgraph=True) fails (cut-cross-entropy 25.1.1, torch 2.11): a "
    "data-dependent guard on the count of valid targets (docs/adapters-gpu.md)",
}


def liger_adapter() -> Adapter:
    """Liger's fused linear cross-entropy (``liger_kernel``), CUDA only: bias, softcap, z-loss
    (``lse_square_scale``) and label smoothing."""
    functional = _import("liger_kernel.transformers.functional", "liger-kernel")
    _need_cuda("liger")

    def loss_2d(call: Call, reduction: str) -> torch.Tensor:
        options = call.options
        return functional.liger_fused_linear_cross_entropy(
            call.hidden, call.weight, call.targets, bias=call.bias,
            ignore_index=call.ignore_index, reduction=reduction, softcap=options.softcap,
            lse_square_scale=options.z_loss, label_smoothing=options.label_smoothing,
        )  # fmt: skip

    # Liger materializes logits chunk by chunk in the input dtype; its loss buffer is fp32.
    caps = Capabilities(options=("bias", "softcap", "z_loss", "label_smoothing"))
    return flat_loss_adapter(
        "liger", loss_2d, contract=NumericalContract(logits="input", outputs="fp32"),
        skip=(("compiled", NO_FULLGRAPH["liger"]),),
        capabilities=caps,
        device="cuda",
        description="liger_kernel.transformers.functional.liger_fused_linear_cross_entropy",
    )  # fmt: skip


def cce_adapter(filter_eps: float | str | None = "high") -> Adapter:
    """Apple's cut-cross-entropy (``impl='cce'``), CUDA only: softcap, and a bias where the
    installed version has one. ``filter_eps``
    is CCE's gradient filter: its default ``"high"`` skips softmax entries below a threshold (an
    approximation by design); ``None`` computes every entry."""
    cce = _import("cut_cross_entropy", "cut-cross-entropy")
    _need_cuda("cce")
    call = f"cut_cross_entropy.linear_cross_entropy(impl='cce', filter_eps={filter_eps!r})"
    # fp32 logits: CCE's kernels accumulate in fp32 (IEEE unless float32 matmul precision is
    # set to "high", then TF32); its loss comes from fp32 log-sum-exp.
    # fp32 is not claimed: CCE's backward asserts "Backwards requires embeddings to be bf16 or
    # fp16" (seen on an H200 with cut-cross-entropy 25.1.1).
    pairs = (("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "bf16"))
    name = "cce" if filter_eps == "high" else "cce-exact"
    return _cce_flat_adapter(
        cce, name, call, pairs, "cuda", NumericalContract(), impl="cce", filter_eps=filter_eps
    )


def cce_compile_adapter() -> Adapter:
    """cut-cross-entropy's ``impl='torch_compile'``: the whole ``[N, V]`` logits in the input
    dtype, softcapped, then an fp32 cross-entropy, under ``torch.compile(fullgraph=True,
    dynamic=True)`` (its own decorator; Inductor on any device, so also on the CPU)."""
    cce = _import("cut_cross_entropy", "cut-cross-entropy")
    call = "cut_cross_entropy.linear_cross_entropy(impl='torch_compile')"
    # Its logits are `e @ c.T` in the input dtype, upcast only for the cross-entropy.
    contract = NumericalContract(logits="input", outputs="fp32")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return _cce_flat_adapter(cce, "cce-compile", call, DEFAULT_PAIRS, device, contract,
                             impl="torch_compile")  # fmt: skip


def _cce_flat_adapter(
    cce, name: str, call: str, pairs, device: str, contract: NumericalContract, **impl_kwargs
) -> Adapter:
    """One of cut-cross-entropy's implementations (``impl_kwargs``) as a flat-loss adapter."""
    # A bias arrived after 25.1.1 (whose function has no such parameter): claimed where it exists.
    has_bias = "bias" in inspect.signature(cce.linear_cross_entropy).parameters

    def loss_2d(call: Call, reduction: str) -> torch.Tensor:
        bias = {"bias": call.bias} if has_bias else {}
        return cce.linear_cross_entropy(
            call.hidden, call.weight, call.targets, ignore_index=call.ignore_index,
            softcap=call.options.softcap, reduction=reduction, **impl_kwargs, **bias,
        )  # fmt: skip

    options = ("bias", "softcap") if has_bias else ("softcap",)
    caps = Capabilities(dtype_pairs=pairs, options=options)
    return flat_loss_adapter(
        name, loss_2d, device=device, description=call, capabilities=caps, contract=contract,
        skip=(("compiled", NO_FULLGRAPH["cce"]),),
    )  # fmt: skip


def _need_hopper(name: str) -> None:
    _need_cuda(name)
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        raise AdapterError(f"adapter {name!r} tests a Hopper (sm_90) kernel; this GPU is "
                           f"sm_{major}{minor}")  # fmt: skip


# bf16 only (the flat adapters cast an fp32 hidden to the weight's dtype, as a linear layer does).
BF16_PAIRS = (("bf16", "bf16"), ("fp32", "bf16"))


def liger_cute_adapter() -> Adapter:
    """Liger's per-token Hopper CuTe DSL op (`LigerFusedLinearScaledCrossEntropyFunction`,
    liger-kernel 0.8.5 with nvidia-cutlass-dsl; on sm_90 only, elsewhere Liger runs a torch
    fallback): fp32 NLL per token of ``(h @ W.T) / temperature``, bf16 only, at least one token
    (its forward divides by the count of 128-token tiles)."""
    module = _import("liger_kernel.ops.fused_linear_scaled_cross_entropy", "liger-kernel")
    _import("liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90", "nvidia-cutlass-dsl")
    _need_hopper("liger-cute")
    function = module.LigerFusedLinearScaledCrossEntropyFunction

    def tokens(call: Call) -> dict[str, torch.Tensor]:
        flat = flattened(call)
        nll = function.apply(flat.hidden, flat.weight, flat.targets, call.options.temperature,
                             call.ignore_index)  # fmt: skip
        return {"logprobs": -nll.view(call.targets.shape)}

    # Its raw dots are staged in fp16 before the fp32 softmax: logits rounded, as "input".
    caps = Capabilities(options=("temperature",), dtype_pairs=BF16_PAIRS, empty=False,
                        limits=Limits(min_tokens=1))  # fmt: skip
    return Adapter(
        "liger-cute", ("logprobs",), tokens, capabilities=caps, device="cuda",
        contract=NumericalContract(logits="input", outputs="fp32"),
        description="liger_kernel LigerFusedLinearScaledCrossEntropyFunction (Hopper CuTe DSL)",
    )  # fmt: skip


def liger_cute_flce_adapter() -> Adapter:
    """Liger's Hopper CuTe DSL fused linear cross-entropy (`liger_fused_linear_cross_entropy_sm90`):
    mean or sum, bf16 only, tokens a multiple of 128 and V of 256 (it raises otherwise)."""
    module = _import("liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90",
                     "liger-kernel nvidia-cutlass-dsl")  # fmt: skip
    _need_hopper("liger-cute-flce")

    def loss_2d(call: Call, reduction: str) -> torch.Tensor:
        return module.liger_fused_linear_cross_entropy_sm90(
            call.hidden, call.weight, call.targets, call.ignore_index, reduction
        )

    limits = Limits(vocab_multiple=256, min_tokens=128, token_multiple=128)
    description = "liger_kernel liger_fused_linear_cross_entropy_sm90 (Hopper CuTe DSL)"
    return _reduced_loss_adapter("liger-cute-flce", loss_2d, BF16_PAIRS, limits, description)


def quack_adapter() -> Adapter:
    """QuACK's `chunked_linear_cross_entropy` (quack-kernels 0.6.5, CuTe DSL), CUDA only: mean or
    sum, bf16 or fp16 (its weight-gradient GEMM takes no fp32), H, V and the token count
    multiples of 8 (16-byte TMA rows; its plain path asserts the count)."""
    module = _import("quack.linear_cross_entropy", "quack-kernels")
    _need_cuda("quack")

    def loss_2d(call: Call, reduction: str) -> torch.Tensor:
        return module.chunked_linear_cross_entropy(
            call.hidden, call.weight, call.targets, ignore_index=call.ignore_index,
            reduction=reduction,
        )  # fmt: skip

    pairs = (*BF16_PAIRS, ("fp16", "fp16"))
    limits = Limits(hidden_multiple=8, vocab_multiple=8, min_tokens=8, token_multiple=8)
    description = "quack.linear_cross_entropy.chunked_linear_cross_entropy"
    return _reduced_loss_adapter("quack", loss_2d, pairs, limits, description)


def _reduced_loss_adapter(name: str, loss_2d, pairs, limits: Limits, description: str) -> Adapter:
    """A CUDA kernel of the mean or summed loss only (no per-token outputs), logits rounded to
    the input dtype before an fp32 loss, refusing T = 0."""
    caps = Capabilities(reductions=("mean", "sum"), dtype_pairs=pairs, empty=False, limits=limits)
    contract = NumericalContract(logits="input", outputs="fp32")
    return flat_loss_adapter(name, loss_2d, capabilities=caps, device="cuda", contract=contract,
                             description=description)  # fmt: skip


class SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP group (Megatron's copy to the
    tensor-parallel region), for kernels that return a rank's partial grad_hidden."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


VERL_PAIRS = (("bf16", "bf16"), ("fp16", "fp16"))


def verl_adapter(pairs: tuple[tuple[str, str], ...] = VERL_PAIRS) -> Adapter:
    """verl's fused kernel, ``verl.utils.kernel.linear_cross_entropy(hidden, weight, labels,
    temperature, reduction, dist_process_group)``: fp32 per-token log-probs and entropy (no loss,
    no ignore_index), CUDA only, vocab-parallel through the group. Its kernel modules are loaded
    without verl's package ``__init__`` (`verify.adapters.verl_kernel`).

    ``pairs``: the (equal) dtype pairs searched. fp32 is its own adapter (``verl-fp32``): its
    ``tl.dot`` runs fp32 inputs on TF32 tensor cores (Triton's default), a finding that would
    otherwise end every fp32 search first and hide the bf16/fp16 ones (docs/adapters-gpu.md)."""
    kernel = verl_kernel.load()
    _need_cuda("verl")

    def tokens(call: Call) -> dict[str, torch.Tensor]:
        hidden = call.hidden
        if call.tp_group is not None and call.reduce_grad_hidden:
            hidden = SumGradOverGroup.apply(hidden, call.tp_group)  # verl leaves it partial
        logprobs, entropy = kernel.linear_cross_entropy(
            hidden, call.weight, call.targets, call.options.temperature, "none", call.tp_group
        )
        return {
            "logprobs": logprobs.view(call.targets.shape),
            "entropy": entropy.view(call.targets.shape),
        }

    # Declared from its host code: `assert hidden_size % 128 == 0`, `assert hidden.is_contiguous()
    # and weight.is_contiguous()`, grad_weight allocated in hidden's dtype (equal pairs only),
    # global ids `offs + rank * vocab_local` (equal shards), and no ignore_index parameter.
    caps = Capabilities(
        ignore_index=False, options=("temperature",), tensor_parallel=True, strided=False,
        dtype_pairs=pairs, limits=Limits(hidden_multiple=128, even_shards=True),
    )  # fmt: skip
    name = "verl" if pairs == VERL_PAIRS else "verl-" + "-".join(h for h, _ in pairs)
    return Adapter(
        name, ("logprobs", "entropy"), tokens, capabilities=caps, device="cuda",
        description=f"verl.utils.kernel.linear_cross_entropy (verl {verl_kernel.version()})",
    )  # fmt: skip


BUILTIN: dict[str, Callable[[], Adapter]] = {
    "lce": lce_adapter,
    "lce-torch": partial(lce_adapter, ("torch",)),
    "lce-triton": partial(lce_adapter, ("triton",)),
    "torch": torch_adapter,
    "liger": liger_adapter,
    "cce": cce_adapter,
    "cce-exact": partial(cce_adapter, None),
    "cce-compile": cce_compile_adapter,
    "liger-cute": liger_cute_adapter,
    "liger-cute-flce": liger_cute_flce_adapter,
    "quack": quack_adapter,
    "verl": verl_adapter,
    "verl-fp32": partial(verl_adapter, (("fp32", "fp32"),)),
}
