"""Load and validate ``tolerances.yaml``: the per-dtype, per-output numbers every verdict uses."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import yaml

# The one source is the repository's top-level tolerances.yaml; a wheel carries it as
# verify/tolerances.yaml (setup.py's build step copies it there: no second copy in the tree).
CHECKOUT_PATH = Path(__file__).resolve().parents[2] / "tolerances.yaml"
PACKAGED_PATH = Path(__file__).resolve().parents[1] / "tolerances.yaml"
ENV_VAR = "LCE_TOLERANCES"  # a user's own file (`lce-verify --tolerances FILE` sets it)
DTYPES = ("fp32", "bf16", "fp16", "fp32_bf16", "fp64")
OUTPUTS = ("logprobs", "entropy", "loss", "grad_hidden", "grad_weight")
FIELDS = ("alpha", "floor", "atol", "rtol", "zeps")
EXACT_FIELDS = ("ignored", "invariance_fp64")
STATISTICAL_FIELDS = ("false_alarm_exponent", "min_dof", "accumulation_share", "model_margin")
_SHORT = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
}


class ToleranceFileError(ValueError):
    """tolerances.yaml is malformed; the message names the key and the fix."""


@dataclass(frozen=True)
class Tolerance:
    """One ``dtype x output`` entry: ratio tier (alpha, floor) and envelope tier (atol, rtol);
    ``zeps`` weighs the rounding of the logits themselves (see `verify.numerics.compare`)."""

    alpha: float
    floor: float
    atol: float
    rtol: float
    zeps: float


@dataclass(frozen=True)
class Statistical:
    """The statistical tier's numbers (`verify.numerics.compare.statistical_tier`):
    a clean output fails with probability at most ``exp(-false_alarm_exponent)``; the tier
    judges outputs with at least ``min_dof`` error components outside the span; elements whose
    accumulation bound exceeds ``accumulation_share`` of their rounding variance are left out;
    ``model_margin`` for rounding residues that are not uniform."""

    false_alarm_exponent: float
    min_dof: float
    accumulation_share: float
    model_margin: float


@dataclass(frozen=True)
class Tolerances:
    entries: dict[str, dict[str, Tolerance]]
    exact: dict[str, float]
    source: str
    # None: the file has no ``statistical`` section (a user's older file), the tier is off
    statistical: Statistical | None = None

    def get(self, dtype_key: str, output: str) -> Tolerance:
        return self.entries[dtype_key][output]


def dtype_key(hidden_dtype: str | torch.dtype, weight_dtype: str | torch.dtype) -> str:
    """The tolerances.yaml key of a (hidden, weight) dtype pair, given as names (``"fp32"``) or
    torch dtypes: ``fp32``, ``bf16``, ... for equal dtypes; ``fp32_bf16`` for fp32 x bf16."""
    hidden, weight = (_SHORT.get(d, d) for d in (hidden_dtype, weight_dtype))
    key = hidden if hidden == weight else f"{hidden}_{weight}"
    if key not in DTYPES:
        raise ValueError(f"no tolerance entry for hidden {hidden_dtype} x weight {weight_dtype}")
    return key


def _number(value: object, where: str, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ToleranceFileError(f"{path}: {where} must be a finite number, got {value!r}")
    if value < 0:
        raise ToleranceFileError(f"{path}: {where} must be >= 0, got {value}")
    return float(value)


def _unknown(keys: object, allowed: tuple[str, ...], where: str, path: str) -> None:
    extra = sorted(set(keys) - set(allowed))  # type: ignore[arg-type]
    if extra:
        raise ToleranceFileError(f"{path}: unknown key(s) {extra} in {where}; allowed: {allowed}")


def parse(data: object, path: str) -> Tolerances:
    """Validate a loaded YAML document; raise `ToleranceFileError` naming the offending key."""
    if not isinstance(data, dict):
        raise ToleranceFileError(f"{path}: top level must be a mapping")
    _unknown(data, ("schema", "dtypes", "exact", "statistical"), "the top level", path)
    if data.get("schema") != 1:
        raise ToleranceFileError(f"{path}: schema must be 1, got {data.get('schema')!r}")
    dtypes = data.get("dtypes") or {}
    _unknown(dtypes, DTYPES, "dtypes", path)
    entries: dict[str, dict[str, Tolerance]] = {}
    for dkey in DTYPES:
        if dkey not in dtypes:
            raise ToleranceFileError(f"{path}: dtypes.{dkey} is missing; add an entry for it")
        outputs = dtypes[dkey] or {}
        _unknown(outputs, OUTPUTS, f"dtypes.{dkey}", path)
        entries[dkey] = {}
        for out in OUTPUTS:
            fields = outputs.get(out)
            if not isinstance(fields, dict):
                raise ToleranceFileError(f"{path}: dtypes.{dkey}.{out} is missing; add {FIELDS}")
            _unknown(fields, FIELDS, f"dtypes.{dkey}.{out}", path)
            missing = [f for f in FIELDS if f not in fields]
            if missing:
                raise ToleranceFileError(f"{path}: dtypes.{dkey}.{out} lacks {missing}")
            entries[dkey][out] = Tolerance(
                *(_number(fields[f], f"dtypes.{dkey}.{out}.{f}", path) for f in FIELDS)
            )
    exact = data.get("exact") or {}
    _unknown(exact, EXACT_FIELDS, "exact", path)
    for f in EXACT_FIELDS:
        if f not in exact:
            raise ToleranceFileError(f"{path}: exact.{f} is missing")
    exact_values = {f: _number(exact[f], f"exact.{f}", path) for f in EXACT_FIELDS}
    return Tolerances(entries, exact_values, path, _statistical(data.get("statistical"), path))


def _statistical(section: object, path: str) -> Statistical | None:
    """The optional ``statistical`` section (absent: the statistical tier is not checked)."""
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ToleranceFileError(f"{path}: statistical must be a mapping of {STATISTICAL_FIELDS}")
    _unknown(section, STATISTICAL_FIELDS, "statistical", path)
    missing = [f for f in STATISTICAL_FIELDS if f not in section]
    if missing:
        raise ToleranceFileError(f"{path}: statistical lacks {missing}")
    return Statistical(*(_number(section[f], f"statistical.{f}", path) for f in STATISTICAL_FIELDS))


def default_path() -> Path:
    """``$LCE_TOLERANCES`` when set, else the file shipped in the wheel, else the checkout's."""
    chosen = os.environ.get(ENV_VAR)
    if chosen:
        return Path(chosen)
    return PACKAGED_PATH if PACKAGED_PATH.is_file() else CHECKOUT_PATH


def load(path: Path | str | None = None) -> Tolerances:
    """The validated tolerance file (``path``, default `default_path`; cached per path)."""
    return _load(Path(path) if path is not None else default_path())


@cache
def _load(path: Path) -> Tolerances:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ToleranceFileError(f"{path}: cannot read it ({exc.strerror})") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise ToleranceFileError(f"{path}: not valid YAML{line}") from exc
    return parse(data, str(path))
