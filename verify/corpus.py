"""The regression corpus: failure artifacts of cases that once failed (``verify/corpus/*.json``).

Every entry must pass on the code as it is; an entry saved from the mutation self-test names its
planted bug, and must still fail with that bug planted (the case still catches the bug class).
`save_kill` turns a self-test kill into such an entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verify import artifacts
from verify.engine import check_case
from verify.properties.runner import Runner
from verify.spec import CaseSpec


def plans(artifact: artifacts.Artifact) -> list[tuple[str | None, bool]]:
    """``(mutant, must_pass)`` runs of one entry: the fix holds; a planted bug is still caught."""
    planted = artifact.record.get("mutant")
    return [(None, True)] + ([(planted, False)] if planted else [])


def save_kill(row: Any, pool: Any | None, directory: Path, device: str = "cpu") -> Path | None:
    """Save a `verify.selftest.KillRow`'s shrunk spec as a corpus entry (None: not killed, or
    the spec fails without the mutant too, so it would not pass as a corpus entry).

    The spec is re-checked with the mutant planted, so the entry holds the verdicts it fails with.
    """
    if not (row.killed and row.clean_passes and row.shrunk_spec):
        return None
    spec = CaseSpec.from_json(row.shrunk_spec)
    verdicts = check_case(spec, properties=[row.property], runner=Runner(pool, row.mutant))
    failing = [v for v in verdicts if v.failed]
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
