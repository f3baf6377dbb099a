"""Two peers' findings of the harness, reproduced without it (CUDA, with the packages installed):
CCE's softcap applied to padded vocab lanes, and Liger's weight gradient dropped when the hidden
states do not require grad (docs/adapters-gpu.md, 2026-12-06). Prints one line per case.

    python benchmarks/peer_findings_gpu.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from cut_cross_entropy import linear_cross_entropy as cce
from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

DEVICE = "cuda"


def reference_nll(hidden, weight, targets, softcap: float | None) -> torch.Tensor:
    """Per-token loss of ``softcap * tanh(hidden @ weight.T / softcap)`` in float64."""
    logits = hidden.double() @ weight.double().T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, targets, reduction="none")


def cce_softcap_errors(vocabs=(3, 256, 257, 1000), caps=(None, 5.0, 1.0)) -> None:
    """CCE's per-token loss against float64: wrong where V is not a multiple of its vocab tile
    and the cap is small against the logits (padded lanes enter the sum as ``exp(-cap)``)."""
    print("CCE softcap: per-token loss error against float64 (bf16 inputs, T = 64, H = 64)")
    for vocab in vocabs:
        for cap in caps:
            hidden = torch.randn(64, 64, device=DEVICE).bfloat16()
            weight = (0.1 * torch.randn(vocab, 64, device=DEVICE)).bfloat16()
            targets = torch.randint(0, vocab, (64,), device=DEVICE)
            got = cce(hidden, weight, targets, softcap=cap, reduction="none", filter_eps=None)
            err = (got.double() - reference_nll(hidden, weight, targets, cap)).abs().max().item()
            print(f"  V={vocab:5d} softcap={cap}: max |loss - ref| = {err:.3g}")


def liger_frozen_hidden() -> None:
    """Liger's weight gradient with and without ``hidden.requires_grad`` against autograd's."""
    print("Liger: weight gradient with hidden.requires_grad False / True (fp32, T = 16, V = 40)")
    for needs in (False, True):
        hidden = torch.randn(16, 32, device=DEVICE, requires_grad=needs)
        weight = torch.randn(40, 32, device=DEVICE, requires_grad=True)
        targets = torch.randint(0, 40, (16,), device=DEVICE)
        liger(hidden, weight, targets).backward()
        ref = weight.detach().clone().requires_grad_(True)
        F.cross_entropy(hidden.detach() @ ref.T, targets).backward()
        if weight.grad is None:
            got = "None"
        else:
            got = f"max |grad - ref| = {(weight.grad - ref.grad).abs().max().item():.3g}"
        print(f"  hidden.requires_grad={needs}: weight.grad {got} (ref norm {ref.grad.norm():.3g})")


if __name__ == "__main__":
    torch.manual_seed(0)
    cce_softcap_errors()
    liger_frozen_hidden()
