"""A correct materialized log-softmax implementation (fp32 outputs), as adapters with any allowed
subset of outputs (per-token only, loss only, both): what third-party kernels look like to the
harness."""

from __future__ import annotations

import os

import torch

from verify.adapters import Adapter, Call, Capabilities, Limits

# Every subset `Adapter` accepts: per-token outputs need log-probs; entropy needs them too.
OUTPUT_SUBSETS = (
    ("logprobs",),
    ("logprobs", "entropy"),
    ("loss",),
    ("logprobs", "loss"),
    ("logprobs", "entropy", "loss"),
)


def token_outputs(call: Call) -> dict[str, torch.Tensor]:
    """fp32 log-probs and entropy of ``hidden @ weight.T`` (hidden cast to weight's dtype first),
    0 where the target is ignored. Computed in float64 and rounded once: an fp32 softmax minus
    one-hot cancels on peaked rows past the fp32 envelope (the torch finding of
    tests/verify/test_adapters.py), and these tests are about the harness, not that rounding."""
    hidden = call.hidden.to(call.weight.dtype).reshape(-1, call.hidden.shape[-1])
    logp = (hidden.double() @ call.weight.double().T).log_softmax(dim=-1)
    targets = call.targets.reshape(-1)
    valid = targets != call.ignore_index
    token = logp.gather(1, torch.where(valid, targets, 0)[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    shape = call.targets.shape
    return {
        "logprobs": torch.where(valid, token, 0.0).float().view(shape),
        "entropy": torch.where(valid, entropy, 0.0).float().view(shape),
    }


def loss(call: Call, reduction: str) -> torch.Tensor:
    nll = -token_outputs(call)["logprobs"]
    if reduction == "none":
        return nll
    valid = (call.targets != call.ignore_index).sum()
    return nll.sum() if reduction == "sum" else nll.sum() / valid


def adapter(outputs: tuple[str, ...], capabilities: Capabilities | None = None) -> Adapter:
    """The implementation computing ``outputs`` (one of `OUTPUT_SUBSETS`)."""
    per_token = {"logprobs", "entropy"} & set(outputs)
    return Adapter(
        "materialized-" + "+".join(outputs),
        outputs,
        token_outputs if per_token else None,
        loss if "loss" in outputs else None,
        capabilities or Capabilities(deterministic=True),
        description="tests.helpers.materialized_impl (fp32 log_softmax of the full logits)",
    )


def per_token_only() -> Adapter:
    """``--impl tests.helpers.materialized_impl:per_token_only``: log-probs and entropy, no loss."""
    return adapter(("logprobs", "entropy"))


def factory_ref(outputs: tuple[str, ...]) -> str:
    """The ``module:function`` ref of the adapter computing ``outputs``."""
    return f"{__name__}:{FACTORIES['+'.join(outputs)].__name__}"


def _factory(outputs: tuple[str, ...]):
    def make() -> Adapter:
        return adapter(outputs)

    make.__name__ = "outputs_" + "_".join(outputs)
    return make


FACTORIES = {"+".join(subset): _factory(subset) for subset in OUTPUT_SUBSETS}
globals().update({factory.__name__: factory for factory in FACTORIES.values()})


class Recorder:
    """A correct per-token kernel that asserts its limits like real kernels do: H a multiple of
    ``hidden_multiple``, at least ``min_tokens`` tokens and a multiple of ``token_multiple`` of
    them (an AssertionError otherwise)."""

    def __init__(self, hidden_multiple: int = 128, min_tokens: int = 2, token_multiple: int = 1):
        self.hidden_multiple, self.min_tokens = hidden_multiple, min_tokens
        self.token_multiple = token_multiple

    def __call__(self, call: Call) -> dict:
        size, rows = call.hidden.shape[-1], call.targets.numel()
        assert size % self.hidden_multiple == 0, f"hidden_size {size} % {self.hidden_multiple}"
        assert rows >= self.min_tokens, f"{rows} tokens"
        assert rows % self.token_multiple == 0, f"{rows} tokens % {self.token_multiple}"
        return token_outputs(call)


def limited() -> Adapter:
    """Asserts H % 128 == 0, >= 2 tokens and an even token count, and declares the three."""
    limits = Limits(hidden_multiple=128, min_tokens=2, token_multiple=2)
    caps = Capabilities(deterministic=True, limits=limits)
    kernel = Recorder(token_multiple=2)
    return Adapter("limited", ("logprobs", "entropy"), kernel, capabilities=caps)


def refuses_one_token() -> Adapter:
    """Asserts >= 2 tokens without declaring it: an undeclared refusal of T < 2."""
    caps = Capabilities(deterministic=True)
    kernel = Recorder(hidden_multiple=1, min_tokens=2)
    return Adapter("refuses-one-token", ("logprobs", "entropy"), kernel, capabilities=caps)


def undeclared_limit() -> Adapter:
    """Asserts H % 128 == 0 without declaring it: every generated case is refused."""
    return Adapter("undeclared", ("logprobs",), Recorder(min_tokens=0))


def two_kernel_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
) -> torch.Tensor:
    """A correct fp32 loss whose ``reduction="none"`` and reduced paths are different kernels,
    as Liger's and CCE's are: per token `F.cross_entropy`, reduced from a logsumexp over the
    vocabulary in reverse order; each token's value agrees to its rounding, not bit for bit."""
    logits = (hidden.to(weight.dtype) @ weight.T).float().reshape(-1, weight.shape[0])
    flat = targets.reshape(-1)
    if reduction == "none":
        nll = torch.nn.functional.cross_entropy(
            logits, flat, reduction="none", ignore_index=ignore_index
        )
        return nll.view(targets.shape)
    valid = flat != ignore_index
    lse = torch.logsumexp(logits.flip(-1), dim=-1)
    target = logits.gather(1, torch.where(valid, flat, 0)[:, None]).squeeze(1)
    total = torch.where(valid, lse - target, 0.0).sum()
    return total if reduction == "sum" else total / valid.sum()


def shuffled_rows_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
) -> torch.Tensor:
    """A correct fp32 loss that visits the tokens in a fresh random order on every call, as
    kernels whose blocks add into shared sums atomically do (CCE): reruns agree to rounding,
    not bit for bit, and it claims no determinism."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    flat = targets.reshape(-1)
    seed = int.from_bytes(os.urandom(8), "little")  # not the harness's seeded generators
    order = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed))
    logits = (rows[order].to(weight.dtype) @ weight.T).float()
    nll = torch.nn.functional.cross_entropy(
        logits, flat[order], reduction=reduction, ignore_index=ignore_index
    )
    return nll[order.argsort()].view(targets.shape) if reduction == "none" else nll
