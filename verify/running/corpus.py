"""The regression corpus: failure artifacts of cases that once failed (``verify/corpus/*.json``).

Every entry must pass on the code as it is; an entry saved from the mutation self-test names its
planted bug, and must still fail with that bug planted (the case still catches the bug class).
`save_kill` turns a self-test kill into such an entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verify.cases.spec import CaseSpec
from verify.distributed.seam import Pool
from verify.execution.mutants import MUTANTS
from verify.execution.runner import Runner
from verify.results import artifacts
from verify.running.engine import check_case


def plans(
    artifact: artifacts.Artifact, backend: str | None = None
) -> list[tuple[str | None, bool]]:
    """``(mutant, must_pass)`` runs of one entry on ``backend`` (None: the entry's): the fix holds;
    a planted bug is still caught, where it reaches that backend (`Mutant.applies_to`)."""
    planted = artifact.record.get("mutant")
    if planted and not MUTANTS[planted].applies_to(backend or artifact.spec.backend):
        planted = None
    return [(None, True)] + ([(planted, False)] if planted else [])


def save_kill(row: Any, pool: Pool | None, directory: Path, device: str = "cpu") -> Path | None:
    """Save a `verify.running.selftest.KillRow`'s shrunk spec as a corpus entry for its killing
    property.

    None when the mutant was not killed, when that property fails the spec without the mutant
    too (the entry would not pass), or passes it with the mutant (the kill needed other
    properties). The entry holds the verdicts it fails with, mutant planted.
    """
    if not (row.killed and row.shrunk_spec and row.property):
        return None
    spec = CaseSpec.from_json(row.shrunk_spec)
    names = [row.property]
    clean = Runner(pool)
    if any(v.failed for v in check_case(spec, properties=names, runner=clean)):
        return None
    planted = Runner(pool, row.mutant)
    verdicts = check_case(spec, properties=names, runner=planted)
    failing = [v for v in verdicts if v.failed]
    if not failing:  # the kill does not reproduce with this property alone
        return None
    record = artifacts.make_record(
        spec,
        row.property,
        failing,
        shrunk=True,
        device=device,
        mutant=row.mutant,
        examples=row.examples,
    )
    return artifacts.write(record, directory)
