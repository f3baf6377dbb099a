"""Replay a failure artifact: re-run its properties on its spec (optionally at another backend or TP
degree), several times, and say whether it passes and whether the runs were bit-identical.

Bit-identity is judged on fingerprints (sha256) of every kernel output of every run and of the
float64 reference; the reference fingerprint does not depend on backend or TP degree, so a replay
at TP=4 of a TP=1 failure shows the same reference numbers bit for bit.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from verify.adapters.interface import Adapter
from verify.adapters.registry import resolve
from verify.cases.spec import CaseSpec
from verify.distributed.seam import Pool
from verify.execution.deadline import ExampleDeadline
from verify.execution.outcome import KernelRun
from verify.execution.runner import Runner
from verify.properties.verdict import FAULTS
from verify.results.artifacts import (
    Artifact,
    display_path,
    is_failure,
    reference_output_sha256,
    reference_sha256,
    update_digest,
    verdict_record,
)
from verify.running.engine import check_case

KEEP = object()  # replay's default for ``mutant``: plant the bug the artifact was found with


@dataclass(frozen=True)
class RunDigest:
    """One replay run: its verdicts (JSON dicts) and the sha256 of every kernel output it made."""

    verdicts: list[dict[str, Any]]
    kernel_sha256: str

    @property
    def passed(self) -> bool:
        return not any(is_failure(v) for v in self.verdicts)

    def numbers(self) -> list[tuple]:
        """What must be bit-identical between runs: each verdict's measured and allowed."""
        return [(v["property"], v["output"], v["measured"], v["allowed"]) for v in self.verdicts]


@dataclass(frozen=True)
class ReplayResult:
    artifact: Artifact
    spec: CaseSpec
    mutant: str | None
    runs: list[RunDigest]
    reference_sha256: str | None
    reference_outputs: dict[str, str] | None = None
    in_worker: bool = False  # the runs went to a pool's workers

    @property
    def passed(self) -> bool:
        return all(run.passed for run in self.runs)

    @property
    def identical(self) -> bool:
        """Every run gave the same kernel outputs and verdict numbers, bit for bit."""
        first = self.runs[0]
        return all(
            r.kernel_sha256 == first.kernel_sha256 and r.numbers() == first.numbers()
            for r in self.runs[1:]
        )

    @property
    def reference_matches_artifact(self) -> bool | None:
        """The reference equals the one recorded in the artifact (None: none recorded)."""
        recorded = self.artifact.record.get("reference_sha256")
        return None if recorded is None else recorded == self.reference_sha256

    @property
    def reference_outputs_differing(self) -> list[str]:
        """Reference outputs whose digest differs from the artifact's (artifacts that record
        them; older ones record only the whole digest)."""
        recorded = self.artifact.record.get("reference_output_sha256") or {}
        here = self.reference_outputs or {}
        return sorted(n for n in recorded.keys() | here.keys() if recorded.get(n) != here.get(n))

    @property
    def reproducible(self) -> bool:
        """The replay computed the artifact's problem: its float64 reference has the recorded
        sha256 (an edited seed or spec, or another R, would give other numbers: then the
        verdicts say nothing about the recorded failure). True when none is recorded."""
        return self.reference_matches_artifact is not False

    @property
    def same_failure(self) -> bool:
        """The first run fails the recorded (property, output, tier) checks and no others: the
        recorded failure reproduces. Its measured values may have moved (`measured_drift`) when
        the code around a planted bug changed since the recording."""
        recorded = {_key(v) for v in self.artifact.verdicts if is_failure(v)}
        failing = {_key(v) for v in self.runs[0].verdicts if is_failure(v)}
        return bool(recorded) and recorded == failing

    @property
    def measured_drift(self) -> float:
        """Largest relative change of a failing verdict's measured value from the recording
        (0: bit-identical)."""
        recorded = {_key(v): float(v["measured"]) for v in self.artifact.verdicts}
        drift = 0.0
        for verdict in self.runs[0].verdicts:
            before, now = recorded.get(_key(verdict)), float(verdict["measured"])
            if before is not None and before != now and not verdict["passed"]:
                drift = max(drift, abs(now - before) / max(abs(before), abs(now)))
        return drift


class _RecordingRunner(Runner):
    """A `Runner` that fingerprints every run it returns, in call order (a fresh one per replay)."""

    def __init__(
        self, pool: Pool | None, mutant: str | None, adapter: Adapter, deadline: ExampleDeadline
    ) -> None:
        super().__init__(pool, mutant, adapter=adapter, deadline=deadline)
        self.digest = hashlib.sha256()

    def run(self, spec: CaseSpec, *, fresh: bool = False) -> KernelRun:
        result = super().run(spec, fresh=fresh)
        self.digest.update(spec.to_json().encode())
        self.digest.update(f"{result.status}|{result.error}".encode())
        update_digest(self.digest, result.outputs)
        return result


def replay(
    artifact: Artifact,
    *,
    backend: str | None = None,
    tp: int | None = None,
    pool: Pool | None = None,
    mutant: str | object | None = KEEP,
    times: int = 2,
    adapter: Adapter | str | None = None,
) -> ReplayResult:
    """Re-run ``artifact``'s properties on its spec ``times`` times, on ``pool``'s workers (a
    crash or a hang then reproduces in a worker process; TP > 1 needs one).

    ``backend``/``tp`` override the spec's; ``mutant`` defaults to the artifact's planted bug
    (``None`` replays on the code as it is); ``adapter``: the implementation (default: the
    artifact's ``impl``, else lce).
    """
    adapter = resolve(adapter or artifact.record.get("impl") or "lce")
    if times < 1:
        raise ValueError(f"times must be >= 1, got {times}")
    spec = artifact.spec
    changes = {k: v for k, v in (("backend", backend), ("tp", tp)) if v is not None}
    spec = spec.with_(**changes) if changes else spec
    planted = artifact.record.get("mutant") if mutant is KEEP else mutant
    names = artifact.property_name.split(",")
    runs = []
    for _ in range(times):
        runner = _RecordingRunner(pool, planted, adapter, replay_deadline(artifact))
        verdicts = check_case(spec, properties=names, runner=runner)
        runs.append(RunDigest([verdict_record(v) for v in verdicts], runner.digest.hexdigest()))
    return ReplayResult(
        artifact, spec, planted, runs, reference_sha256(spec),  # type: ignore[arg-type]
        reference_output_sha256(spec), pool is not None,
    )  # fmt: skip


def replay_deadline(artifact: Artifact) -> ExampleDeadline:
    """The per-example deadline the artifact was found under, as the floor (a hang's replay
    waits as long as its search did; a fixed one stays fixed), else the default rule."""
    recorded = artifact.record.get("example_deadline_s")
    if not recorded:
        return ExampleDeadline()
    return ExampleDeadline(recorded, fixed=bool(artifact.record.get("example_deadline_fixed")))


def _key(verdict: dict[str, Any]) -> tuple[str, str, str]:
    return (verdict["property"], verdict["output"], verdict["tier"])


def summary_lines(result: ReplayResult, expect_pass: bool | None = None) -> list[str]:
    """What `replay` prints: the outcome, flakiness, reference fingerprint, failing verdicts;
    ``expect_pass`` (corpus runs) flags an outcome other than the expected one."""
    spec, first = result.spec, result.runs[0]
    outcome = "passed" if result.passed else "FAILED"
    planted = f", planted bug {result.mutant}" if result.mutant else ""
    expectation = ""
    if expect_pass is not None and result.passed != expect_pass:
        expectation = " (UNEXPECTED: " + ("should pass)" if expect_pass else "bug not caught)")
    matches = {True: "matches the artifact", False: "DIFFERS from artifact", None: "not recorded"}
    match = matches[result.reference_matches_artifact]
    if result.reference_matches_artifact is False and result.artifact.record.get(
        "reference_output_sha256"
    ):
        match += f" on {', '.join(result.reference_outputs_differing)}"
    lines = [
        f"{display_path(result.artifact.path)}: {outcome}{expectation} "
        f"[{result.artifact.property_name} on {spec.backend} TP={spec.tp}{planted}]",
        f"  runs: {len(result.runs)}, bit-identical: {'yes' if result.identical else 'NO (flaky)'}"
        f"; kernel sha256 {first.kernel_sha256[:16]}",
        f"  reference sha256 {(result.reference_sha256 or 'none')[:16]} ({match})",
    ]
    if not result.reproducible:
        lines.append("  DOES NOT REPRODUCE: the recomputed reference differs from the recorded one")
    recorded_faults = sorted({v["tier"] for v in result.artifact.verdicts if v["tier"] in FAULTS})
    if recorded_faults:
        happened = sorted({v["tier"] for v in first.verdicts if v["tier"] in FAULTS})
        where = "in a worker process" if result.in_worker else "in this process"
        said = f"yes ({', '.join(happened)})" if happened else "NO"
        lines.append(f"  {' / '.join(recorded_faults)} reproduced {where}: {said}")
    if not result.passed and result.artifact.verdicts:
        same = "no"
        if result.same_failure:
            drift = result.measured_drift
            same = "yes, bit for bit" if drift == 0 else f"yes (measured moved by {drift:.2g})"
        lines.append(f"  same failure as recorded: {same}")
    for verdict in first.verdicts:
        if not verdict["passed"]:
            measured, allowed = float(verdict["measured"]), float(verdict["allowed"])
            lines.append(
                f"  {verdict['property']} {verdict['output']} [{verdict['tier']}]: measured "
                f"{measured:.6g} vs allowed {allowed:.6g}"
            )
    return lines
