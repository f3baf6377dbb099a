"""A correct materialized log-softmax implementation (fp32 outputs), as adapters with any allowed
subset of outputs (per-token only, loss only, both): what third-party kernels look like to the
harness."""

from __future__ import annotations

import torch

from verify.adapters import Adapter, Call, Capabilities

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
    tests/test_adapters.py), and these tests are about the harness, not that rounding."""
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
        description="tests.materialized_impl (fp32 log_softmax of the full logits)",
    )


def per_token_only() -> Adapter:
    """``--impl tests.materialized_impl:per_token_only``: log-probs and entropy, no loss."""
    return adapter(("logprobs", "entropy"))
