"""Which compiled specializations of lce's Triton kernels a spec's run launches, found on the CPU
without running a kernel.

Triton compiles a kernel once per key: each argument's specialization (an int's value class,
== 1 / divisible by 16 / other, a pointer's 16-byte alignment, unless the kernel's
``do_not_specialize`` lists it), the constexprs and the launch options. `recording` replaces the
kernels' launches by a recorder of that key, computed by Triton's own ``native_specialize_impl``,
under the GPU tile config and an H200's persistent program count; the launches' outputs stay
unwritten. Import this module in a process of its own without ``TRITON_INTERPRET`` (the kernels
must be compiled `JITFunction`s), never where kernels must run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction

import lce.backends
from lce.backends.triton import backward_kernel, forward_kernel, loss_kernels, target_kernel
from verify.adapters.registry import resolve
from verify.cases.spec import CaseSpec
from verify.cases.strategies import campaign_specs
from verify.execution.execute import LocalRank, execute

H200_SMS = 132
KERNELS: dict[str, JITFunction] = {
    "forward": forward_kernel._forward_partials_kernel,
    "merge": forward_kernel._merge_partials_kernel,
    "target": target_kernel._target_logits_kernel,
    "d_logits": backward_kernel._dlogits_kernel,
    "place_target": target_kernel._place_target_kernel,
    "row_stats": loss_kernels._row_stats_kernel,
    "row_dlogits": loss_kernels._row_dlogits_kernel,
}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion")

Key = tuple[str, tuple]


def specialization_key(kernel: JITFunction, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """What Triton keys a compile on: each argument's specialization (or constexpr value) under
    the kernel's ``do_not_specialize`` flags, and the launch options."""
    options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
    bound = kernel.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    key = []
    for param in kernel.params:
        value = bound.arguments[param.name]
        if param.is_constexpr:
            key.append(("constexpr", value))
        else:
            specialize = not param.do_not_specialize
            align = not param.do_not_specialize_on_alignment
            const = param.is_const
            key.append(native_specialize_impl(BaseBackend, value, const, specialize, align))
    return (tuple(key), tuple(sorted(options.items())))


@contextlib.contextmanager
def recording() -> Iterator[set[Key]]:
    """Within: the kernels' launches add ``(kernel name, key)`` to the yielded set, run nothing."""
    seen: set[Key] = set()

    def recorder(name: str, kernel: JITFunction) -> Callable:
        def run(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            seen.add((name, specialization_key(kernel, args, dict(kwargs))))

        return run

    saved = (forward_kernel._persistent_programs, lce.backends._triton_usable)
    forward_kernel._persistent_programs = lambda device: H200_SMS
    lce.backends._triton_usable = lambda device: True  # CPU tensors: the launches never run
    for name, kernel in KERNELS.items():
        kernel.run = recorder(name, kernel)
    try:
        yield seen
    finally:
        for kernel in KERNELS.values():
            del kernel.run  # the class's launch again
        forward_kernel._persistent_programs, lce.backends._triton_usable = saved


def launch(spec: CaseSpec) -> None:
    """Run ``spec``'s lce call and gradients (within `recording`: record their keys)."""
    with contextlib.suppress(Exception):  # outputs left unwritten: a check on them may raise
        execute(spec, LocalRank(torch.device("cpu")), resolve("lce"))


def drawn_specs(
    examples: int, seed_value: int, pairs: tuple[tuple[str, str], ...] | None = None
) -> list[CaseSpec]:
    """``examples`` specs of the Triton TP=1 slice's strategy, drawn as a search's generate
    phase draws them (same strategy, no shrinking)."""
    strategy = campaign_specs(
        backends=("triton",), tp_sizes=(1,), **({"pairs": pairs} if pairs else {})
    )
    specs: list[CaseSpec] = []

    @seed(seed_value)
    @settings(
        max_examples=examples,
        phases=[Phase.generate],
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def draw(spec: CaseSpec) -> None:
        specs.append(spec)

    draw()
    return specs
