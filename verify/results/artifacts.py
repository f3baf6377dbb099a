"""Failure artifacts: one JSON file per failing case that replays the same numbers on any machine.

An artifact holds the case spec, the failing verdicts, the versions and device it ran on, the
tolerance entries it was judged by and a one-line replay command. Files are written atomically
(temp file + ``os.replace``) under a name derived from their content, so a file is never
overwritten with other content and the same failure found twice is stored once.
Format: docs/report-format.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, is_dataclass
from datetime import UTC, datetime
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from verify.adapters.interface import Adapter
from verify.cases.spec import WRITTEN_WHEN_SET, CaseSpec
from verify.execution.mutants import MUTANTS
from verify.numerics.tolerances import EXACT_FIELDS, FIELDS, OUTPUTS, Tolerances
from verify.numerics.tolerances import load as load_tolerances
from verify.properties.catalog import PROPERTIES
from verify.properties.oracle import oracle

SCHEMA = "lce-failure"
SCHEMA_VERSION = 1
PACKAGES = ("lce", "torch", "triton", "hypothesis", "megatron-core", "numpy")
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when verify runs from one
REQUIRED = ("schema", "schema_version", "spec", "property", "backend", "tp", "verdicts")
# CaseSpec fields added after artifacts were first written, with the behaviour older artifacts
# had before the field existed; every other field must be recorded. (Those `CaseSpec.to_json`
# writes only when set are among them: specs keep the JSON, names and fingerprints they had.)
ADDED_LATER: dict[str, Any] = {"reduce_hidden": True, **WRITTEN_WHEN_SET}


class ArtifactError(ValueError):
    """A file is not a readable failure artifact; the message names the file and the fix."""


@dataclass(frozen=True)
class Artifact:
    """A loaded artifact: the parsed spec plus the raw record (``record`` is the JSON dict)."""

    path: Path
    spec: CaseSpec
    record: dict[str, Any]

    @property
    def property_name(self) -> str:
        return self.record["property"]

    @property
    def verdicts(self) -> list[dict[str, Any]]:
        return self.record["verdicts"]


def versions() -> dict[str, str | None]:
    """python, the installed versions of the packages a result depends on (None: absent) and,
    run from a git checkout, its commit (``lce-source``): a seed draws the same examples only
    with the same harness, and a kernel fix is a commit, not a version number."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    found["lce-source"] = source_revision()
    return found


@lru_cache(maxsize=1)
def source_revision() -> str | None:
    """``git describe --always --dirty`` of the checkout verify runs from (e.g. ``15a3a1e``, or
    ``15a3a1e-dirty`` with uncommitted changes); None for an installed copy or without git.
    Asked once per process: the code it ran is the code it imported."""
    if not (SOURCE_ROOT / ".git").exists():
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(SOURCE_ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def device_description(device: str = "cpu") -> str:
    """``cpu (x86_64, Linux)`` or the CUDA device's name; what a reader needs to reproduce."""
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.machine()}, {platform.system()})"


def json_number(value: float) -> float | str:
    """A float as strict JSON allows: non-finite values become ``"inf"``, ``"-inf"``, ``"nan"``."""
    value = float(value)
    return value if math.isfinite(value) else str(value)


def parse_number(value: float | str) -> float:
    """Inverse of `json_number`."""
    return float(value)


def verdict_record(verdict: Any) -> dict[str, Any]:
    """A verdict object (dataclass or ``to_json()``) as a JSON-safe dict, without its spec."""
    if hasattr(verdict, "to_json"):
        data = verdict.to_json()
        data = json.loads(data) if isinstance(data, str) else dict(data)
    elif is_dataclass(verdict):
        data = asdict(verdict)
    elif isinstance(verdict, dict):
        data = dict(verdict)
    else:
        raise TypeError(f"cannot record a verdict of type {type(verdict).__name__}")
    data.pop("spec", None)  # the spec is stored once, at the top of the artifact
    return {key: _json_safe(value) for key, value in data.items()}


def reference_sha256(spec: CaseSpec) -> str | None:
    """sha256 of the float64 reference outputs of ``spec``: the same at every backend and TP
    degree (None when the spec has no reference, e.g. an invalid input for the status property)."""
    ref = _reference_outputs(spec)
    if ref is None:
        return None
    digest = hashlib.sha256()
    update_digest(digest, ref)
    return digest.hexdigest()


def reference_output_sha256(spec: CaseSpec) -> dict[str, str] | None:
    """Per reference output, the first 16 hex digits of its sha256 (as in `reference_sha256`),
    so a replay that differs says where; None when the spec has no reference."""
    ref = _reference_outputs(spec)
    if ref is None:
        return None
    out = {}
    for name, tensor in sorted(ref.items()):
        digest = hashlib.sha256()
        update_digest(digest, {name: tensor})
        out[name] = digest.hexdigest()[:16]
    return out


def _reference_outputs(spec: CaseSpec) -> dict[str, torch.Tensor] | None:
    try:
        ref = oracle(spec).ref
    except Exception:  # the reference is evidence, not a requirement: never block saving
        return None
    # -0.0 and +0.0 are the same reference value; adding +0.0 makes every zero +0.0, so a change
    # in how R orders a sign (e.g. the loss upstream's) does not read as another problem
    return {name: t + 0.0 if t.is_floating_point() else t for name, t in ref.items()}


def update_digest(digest: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Feed name, dtype, shape and raw bytes of each tensor (in name order) into ``digest``."""
    for name in sorted(tensors):
        value = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())


def is_failure(verdict: dict[str, Any]) -> bool:
    """A recorded verdict that fails (older artifacts' "known" classes fail too: none is
    excused)."""
    return not verdict.get("passed", True)


def tolerance_entries(dtype_key: str, outputs: list[str], tolerances: Tolerances) -> dict:
    """The tolerances.yaml entries verdicts on ``outputs`` at ``dtype_key`` were judged by
    (``loss_grad_hidden`` and ``grad_hidden[ignored]`` by ``grad_hidden``; unknown names: all)."""
    judged = {out.split("[")[0].removeprefix("loss_") for out in outputs}
    known = [out for out in OUTPUTS if out in judged] or list(OUTPUTS)
    entries = tolerances.entries.get(dtype_key, {})
    return {
        "source": Path(tolerances.source).name,
        "sha256": _file_sha256(tolerances.source),
        "dtype": dtype_key,
        "entries": {
            out: {f: getattr(entries[out], f) for f in FIELDS} for out in known if out in entries
        },
        "exact": {f: tolerances.exact[f] for f in EXACT_FIELDS},
    }


def make_record(
    spec: CaseSpec,
    prop: str,
    verdicts: list[Any],
    *,
    shrunk: bool,
    device: str = "cpu",
    error: str | None = None,
    mutant: str | None = None,
    examples: int | None = None,
    tolerances: Tolerances | None = None,
    impl: Adapter | None = None,
    example_deadline_s: float | None = None,
    example_deadline_fixed: bool = False,
) -> dict[str, Any]:
    """The artifact dict of a failure of property ``prop`` on ``spec`` (backend and TP from spec)
    by the implementation ``impl`` (None: lce).

    ``error`` carries an exception's one-line summary when the case raised instead of returning
    verdicts; ``mutant`` names a planted bug when the failure was found with one active;
    ``examples`` is how many examples the search ran before this failure;
    ``example_deadline_s`` the per-example deadline then (a hang's replay waits as long);
    ``example_deadline_fixed``: it was the caller's fixed one, not the growing rule (its replay
    keeps it fixed: no longer rerun).
    """
    records = [verdict_record(v) for v in verdicts]
    outputs = [str(r.get("output")) for r in records]
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "property": prop,
        "impl": (impl.ref or impl.name) if impl is not None else "lce",
        "label": impl.label(spec.backend) if impl is not None else f"lce-{spec.backend}",
        "backend": spec.backend,
        "tp": spec.tp,
        "dtype": spec.dtype_key,
        "spec": json.loads(spec.to_json()),
        "verdicts": records,
        "error": error,
        "shrunk": shrunk,
        "mutant": mutant,
        "examples": examples,
        "example_deadline_s": example_deadline_s,
        **({"example_deadline_fixed": True} if example_deadline_fixed else {}),
        "reference_sha256": reference_sha256(spec),
        "reference_output_sha256": reference_output_sha256(spec),
        "versions": versions(),
        "device": device_description(device),
        "tolerances": tolerance_entries(spec.dtype_key, outputs, tolerances or load_tolerances()),
    }


def content_hash(record: dict[str, Any]) -> str:
    """sha256 of the record without its volatile fields (creation time, own path, replay line)."""
    stable = {k: v for k, v in record.items() if k not in ("created", "replay")}
    text = json.dumps(stable, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def write(record: dict[str, Any], failures_dir: Path | str) -> Path:
    """Write ``record`` into ``failures_dir`` atomically; returns its path.

    The name ``<property>[+n]-<backend>-tp<k>-<hash>.json`` comes from the content hash: an
    existing file of that name already holds this failure and is left as it is (never overwritten).
    """
    directory = Path(failures_dir)
    directory.mkdir(parents=True, exist_ok=True)
    digest = content_hash(record)
    props = record["property"].split(",")
    label = props[0] + (f"+{len(props) - 1}" if len(props) > 1 else "")
    stem = _slug(f"{label}-{record.get('label', record['backend'])}-tp{record['tp']}")
    path = directory / f"{stem}-{digest[:16]}.json"
    if path.exists():
        return path
    full = dict(record)
    full["created"] = _now()
    full["replay"] = replay_command(path)
    # Same name = same content hash, so a racing writer wrote the same.
    _write_json_atomically(full, path)
    return path


def rehash(path: Path | str) -> tuple[str | None, str | None]:
    """Re-record an artifact's reference sha256s as R computes them now, after a deliberate change
    to R; returns the (old, new) whole-reference hashes. The file is rewritten only when they
    differ, with the time in ``reference_rehashed``."""
    artifact = load(path)
    old, new = artifact.record.get("reference_sha256"), reference_sha256(artifact.spec)
    if old != new:
        record = dict(artifact.record)
        record["reference_sha256"] = new
        record["reference_output_sha256"] = reference_output_sha256(artifact.spec)
        record["reference_rehashed"] = _now()
        _write_json_atomically(record, artifact.path)
    return old, new


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _write_json_atomically(record: dict[str, Any], path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(record, handle, indent=1, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replay_command(path: Path | str) -> str:
    """The one line that replays ``path``."""
    return f"python -m verify replay {display_path(path)}"


def display_path(path: Path | str) -> Path:
    """``path`` relative to the working directory when it lies under it, else as given."""
    path = Path(path)
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def load(path: Path | str) -> Artifact:
    """Read and validate an artifact; raise `ArtifactError` naming the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no such file; pass a failure artifact written by a campaign")
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        raise ArtifactError(f"{path}: not a failure artifact (its 'schema' is not {SCHEMA!r})")
    missing = [key for key in REQUIRED if key not in record]
    if missing:
        raise ArtifactError(f"{path}: failure artifact lacks {missing}")
    version = record["schema_version"]
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ArtifactError(
            f"{path}: schema_version {version!r} is newer than this verify ({SCHEMA_VERSION}); "
            "update the repository"
        )
    _check_names(path, record)
    data = record["spec"]
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: invalid spec: expected a JSON object, got {data!r}")
    missing = sorted(set(CaseSpec.__dataclass_fields__) - set(data) - set(ADDED_LATER))
    if missing:  # a field left out would silently take its default: other numbers
        raise ArtifactError(f"{path}: spec lacks {missing}; an artifact records every field")
    try:
        spec = CaseSpec.from_json({**ADDED_LATER, **data})
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"{path}: invalid spec: {exc}") from exc
    return Artifact(path, spec, record)


def _check_names(path: Path, record: dict[str, Any]) -> None:
    """The artifact's properties and planted bug exist in this verify."""
    unknown = [n for n in str(record["property"]).split(",") if n not in PROPERTIES]
    if unknown:
        raise ArtifactError(f"{path}: unknown property {unknown}; known: {', '.join(PROPERTIES)}")
    mutant = record.get("mutant")
    if mutant is not None and mutant not in MUTANTS:
        raise ArtifactError(f"{path}: unknown mutant {mutant!r}; known: {', '.join(MUTANTS)}")


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return json_number(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", text)[:80]


def _file_sha256(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None
