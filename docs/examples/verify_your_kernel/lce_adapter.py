"""The adapter: tells the lce harness how to call `my_kernel` and what it supports."""

from __future__ import annotations

from my_kernel import token_logprobs_entropy

from verify.adapters import Adapter, Call, Capabilities, Limits, NumericalContract


def _token_outputs(call: Call) -> dict:
    # The harness may pass 3-D hidden [B, T, H]; this kernel takes 2-D, so flatten and restore.
    hidden = call.hidden.reshape(-1, call.hidden.shape[-1])
    logprobs, entropy = token_logprobs_entropy(
        hidden, call.weight, call.targets.reshape(-1),
        ignore_index=call.ignore_index, temperature=call.temperature,
    )  # fmt: skip
    return {
        "logprobs": logprobs.view(call.targets.shape),
        "entropy": entropy.view(call.targets.shape),
    }


def adapter() -> Adapter:
    """What `--lce-impl lce_adapter:adapter` resolves to."""
    return Adapter(
        name="my_kernel",
        outputs=("logprobs", "entropy"),  # per-token outputs only: no loss
        token_outputs=_token_outputs,
        capabilities=Capabilities(
            options=("temperature",),  # of the model options, it takes the temperature
            deterministic=True,
            strided=False,  # it asserts contiguous inputs
            limits=Limits(hidden_multiple=128),  # it asserts hidden_size % 128 == 0
        ),
        contract=NumericalContract(logits="fp32", outputs="fp32"),
        description="my_kernel.token_logprobs_entropy",
    )
