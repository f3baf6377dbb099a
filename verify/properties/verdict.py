"""`PropertyVerdict`: one property's judgement of one output of one case, printable in one line.

Wraps `verify.numerics.compare.Verdict` (tiers ratio / envelope / nonfinite) and adds the exact-tier
and
status checks, the property's name and the spec, so a failure says what, where, by how much, and
how to replay it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from traceback import format_exception

import torch

from verify.adapters.interface import OUTPUTS as CONTRACT_OUTPUTS
from verify.cases.spec import CaseSpec
from verify.execution.outcome import TOLERANCE_OUTPUT
from verify.numerics.compare import Verdict, compare, half_subnormal, nonfinite_mismatch, ratio
from verify.numerics.tolerances import Tolerance, load
from verify.properties.oracle import buffer_rounding, oracle
from verify.properties.rounding_model import rounding_model

# Tier of a verdict that records an exception raised by a property's own code: a bug of the
# harness, not a verdict on the implementation (reported apart, with its own exit code).
HARNESS = "harness"
# Tiers of a verdict that records the implementation crashing or hanging (`ImplementationFault`).
FAULTS = ("crash", "hang")


@dataclass(frozen=True)
class PropertyVerdict:
    """``ratio`` = measured / allowed (<= 1 passes; inf when nothing was allowed)."""

    property: str
    output: str
    tier: str  # ratio | envelope | nonfinite | exact | status | crash | hang | harness
    passed: bool
    measured: float
    allowed: float
    ratio: float
    detail: str
    spec: str  # CaseSpec JSON
    traceback: str = ""  # tier "harness" only: where the property's own code raised

    @property
    def failed(self) -> bool:
        return not self.passed

    def to_json(self) -> dict:
        data = asdict(self)
        data["spec"] = json.loads(self.spec)
        return data

    def line(self) -> str:
        """The one-line failure message: property, output, tier, measured vs allowed, spec JSON."""
        state = "passed" if self.passed else "FAILED"
        if self.tier == HARNESS:
            state = "HARNESS ERROR"
        return (
            f"{self.property} {state} on {self.output} [{self.tier}]: measured {self.measured:.4g}"
            f" vs allowed {self.allowed:.4g} ({self.detail}) spec={self.spec}"
        )


def from_compare(prop: str, spec: CaseSpec, verdict: Verdict) -> PropertyVerdict:
    return PropertyVerdict(
        prop, verdict.output, verdict.tier, verdict.passed, verdict.measured,
        verdict.allowed, verdict.ratio, verdict.detail, spec.to_json(),
    )  # fmt: skip


def tolerance_check(
    prop: str,
    spec: CaseSpec,
    output: str,
    kernel: torch.Tensor,
    ref: torch.Tensor,
    base: torch.Tensor | None,
    tol: Tolerance,
    runs: int = 1,
    extra: torch.Tensor | None = None,
    columns: slice | None = None,
    dot_rounding: bool = False,
    statistical: bool = False,
    returned: str | None = None,
) -> PropertyVerdict:
    """Tiers 1-2 of tolerances.yaml: ``kernel`` vs float64 ``ref``; ``base`` is B's value;
    ``runs`` and ``extra`` as in `verify.numerics.compare.compare`. ``columns``: judge only these
    columns of a 2-D output (its logit scale cut alike). ``dot_rounding``: the logit term
    counts each dot's summation rounding (see `verify.properties.oracle.logit_scales`).
    ``statistical``: ``ref`` is the spec's own R and ``base`` its B, so the statistical tier
    applies too (`verify.properties.rounding_model`). ``returned``: the dtype the
    implementation returned ``kernel`` in (`KernelRun.dtypes`), whose rounding
    `returned_rounding` grants."""
    own = returned_rounding(output, kernel, returned)
    if own is not None:
        extra = own if extra is None else extra + own
    scale = subnormal = rounding = None
    if statistical and runs == 1 and columns is None:
        rounding = rounding_model(spec, output, kernel.dtype, load().statistical)
    if spec.fault == "none":
        known = oracle(spec)
        scale = known.logit_scales(dot_rounding).get(output)
        subnormal = known.subnormal_bounds.get(output)
        if output == "loss_grad_weight" and spec.loss_path == "main_grad":
            # what main_grad gained carries the buffer's own rounding, whoever judges it
            gained = buffer_rounding(known)
            subnormal = gained if subnormal is None else subnormal + gained
    if subnormal is not None and subnormal.numel() == ref.numel():
        # tensors of the spec's problem only (tests of the tiers pass others)
        subnormal = subnormal.reshape(ref.shape)
        extra = subnormal if extra is None else extra + subnormal
    if columns is not None:
        kernel, ref = kernel[:, columns], ref[:, columns]
        base = None if base is None else base[:, columns]
        scale = None if scale is None else scale[:, columns]
        extra = None if extra is None else extra[:, columns]
    if scale is not None and scale.numel() != ref.numel():
        scale = None  # tensors not of the spec's problem (tests of the tiers): no logit term
    # Partial grad_hidden per rank (sequence parallel): tp roundings, then their sum's.
    partials = output.endswith("grad_hidden") and not spec.reduce_hidden and spec.tp > 1
    roundings = spec.tp + 1 if partials else 1
    verdict = compare(output, kernel, ref, base, tol, runs, scale, extra, roundings, rounding)
    return from_compare(prop, spec, verdict)


def returned_rounding(
    output: str, kernel: torch.Tensor, returned: str | None
) -> torch.Tensor | None:
    """The rounding of a log-prob, entropy or loss the implementation returned in a 16-bit dtype
    (a contract of input-dtype outputs, `NumericalContract.outputs`), elementwise: ``u |K| + s/2``
    with ``u`` that dtype's unit roundoff and ``s`` its smallest subnormal (a round-to-nearest
    result is off by at most half its spacing, ``u |K|`` at most). tolerances.yaml's entries for
    these outputs are set for fp32 results: without this a correctly rounded bf16 loss of
    near-uniform rows (|z| << the loss, so no logit term covers it) failed. None for every other
    output and dtype (the gradients' entries grant their own dtype's rounding in the floor)."""
    if returned is None or TOLERANCE_OUTPUT.get(output) not in CONTRACT_OUTPUTS:
        return None
    dtype = getattr(torch, returned.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or dtype.itemsize != 2:
        return None
    unit = torch.finfo(dtype).eps / 2
    return unit * kernel.detach().to(torch.float64).abs() + half_subnormal(dtype)


def tolerance_for(spec: CaseSpec, output: str) -> Tolerance:
    """tolerances.yaml's entry for a run's ``output`` (`TOLERANCE_OUTPUT` names its entry) at
    ``spec``'s dtype pair."""
    return load().get(spec.dtype_key, TOLERANCE_OUTPUT[output])


def pair_check(
    prop: str,
    spec: CaseSpec,
    output: str,
    kernel: torch.Tensor,
    other: torch.Tensor,
    base_error: torch.Tensor,
    tol: Tolerance,
    returned: str | None = None,
) -> PropertyVerdict:
    """Two kernel runs that must agree as closely as each agrees with R (the TP rule of
    docs/DESIGN.md): both may be off by their own bound, so ``|kernel - other|`` is held to the
    sum of the two runs' tiers, with ``base_error = |B1 - R1| + |B2 - R2|`` (elementwise) as the
    ratio tier's scale.
    A single run's bound would fail two runs that each pass against R (a B that rounds one of
    the two problems unusually well: docs/bench/properties.md)."""
    other64 = other.detach().to(torch.float64)
    base = other64 + base_error.to(torch.float64)
    args = (prop, spec, output, kernel, other64, base, tol)
    return tolerance_check(*args, runs=2, returned=returned)


def exact_check(
    prop: str,
    spec: CaseSpec,
    output: str,
    kernel: torch.Tensor,
    expected: torch.Tensor,
    rel: float = 0.0,
    atol: float = 0.0,
) -> PropertyVerdict:
    """Normwise ``||kernel - expected|| <= rel * ||expected|| + atol * sqrt(n)`` (both 0: bit-equal
    values), with equal NaN/inf patterns; for the exact tier (ignored rows, invariances in fp64)."""
    k = kernel.detach().to(torch.float64).reshape(-1)
    e = expected.detach().to(torch.float64).reshape(-1)
    if k.shape != e.shape:
        return flag(prop, spec, output, False, f"shape {tuple(k.shape)} != {tuple(e.shape)}")
    if nonfinite_mismatch(k, e):
        return bound_check(
            prop, spec, output, math.inf, 0.0, "nonfinite", "NaN/inf pattern differs"
        )
    finite = torch.isfinite(e)
    k, e = k[finite], e[finite]
    measured = torch.linalg.vector_norm(k - e).item() if k.numel() else 0.0
    allowed = 0.0
    if k.numel():
        allowed = rel * torch.linalg.vector_norm(e).item() + atol * math.sqrt(k.numel())
    floor = f" + {atol:g} * sqrt(n)" if atol else ""
    detail = f"||K-E|| {measured:.3g} <= {rel:g} * ||E||{floor}"
    return bound_check(prop, spec, output, measured, allowed, "exact", detail)


def bound_check(
    prop: str,
    spec: CaseSpec,
    output: str,
    measured: float,
    allowed: float,
    tier: str,
    detail: str = "",
) -> PropertyVerdict:
    """A verdict from an already measured quantity and its bound (NaN measured fails)."""
    value = ratio(measured, allowed)
    return PropertyVerdict(
        prop, output, tier, value <= 1.0, measured, allowed, value,
        detail or f"{measured:.3g} <= {allowed:.3g}", spec.to_json(),
    )  # fmt: skip


def flag(prop: str, spec: CaseSpec, output: str, ok: bool, detail: str) -> PropertyVerdict:
    """A yes/no contract clause (dtype, status, inputs untouched): measured 0 or 1, allowed 0."""
    measured = 0.0 if ok else 1.0
    return PropertyVerdict(
        prop, output, "status" if "status" in output else "exact", ok, measured, 0.0,
        ratio(measured, 0.0), detail, spec.to_json(),
    )  # fmt: skip


def harness_error(prop: str, spec: CaseSpec, exc: BaseException) -> PropertyVerdict:
    """``prop``'s own code raised ``exc`` on ``spec``: a failed verdict of tier `HARNESS` with the
    exception in ``detail`` and its traceback."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return PropertyVerdict(
        prop, "harness", HARNESS, False, math.inf, 0.0, math.inf,
        f"{type(exc).__name__}: {first} (a harness bug, not a verdict on the implementation)",
        spec.to_json(), traceback="".join(format_exception(exc)),
    )  # fmt: skip


def fault_verdict(
    prop: str, spec: CaseSpec, kind: str, detail: str, on: CaseSpec
) -> PropertyVerdict:
    """The implementation crashed or hung (``kind``, confirmed on a fresh worker) while ``prop``
    ran ``on`` (``spec`` or a case it derives from it): a failing verdict of that tier."""
    where = "" if on == spec else f" (on the case it derives: {on.to_json()})"
    return PropertyVerdict(
        prop, "process", kind, False, math.inf, 0.0, math.inf, detail + where, spec.to_json()
    )


def is_fault(verdict: PropertyVerdict) -> bool:
    """Whether ``verdict`` records a crash or a hang of the implementation."""
    return verdict.tier in FAULTS


# Detail prefix of a verdict recording that the implementation raised on a valid case.
REFUSED = "refused a valid case"


def refused(prop: str, spec: CaseSpec, error: str) -> PropertyVerdict:
    """The implementation raised ``error`` on the valid ``spec``: a failed status verdict."""
    return flag(prop, spec, "status", False, f"{REFUSED}: {error}")


def is_refusal(verdict: PropertyVerdict) -> bool:
    """Whether ``verdict`` records a refusal of a valid case (see `refused`)."""
    return verdict.tier == "status" and verdict.detail.startswith(REFUSED)
