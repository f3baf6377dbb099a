"""Replay a failure artifact through the implementation it names (its ``impl`` field).

The same as `verify.replay.replay` (same fingerprints, same `ReplayResult`, same printed summary),
with the runs routed to the adapter; artifacts without ``impl`` replay on lce.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verify import artifacts
from verify.adapters.protocol import Adapter
from verify.adapters.registry import resolve
from verify.adapters.runner import ImplPool
from verify.engine import check_case
from verify.replay import ReplayResult, RunDigest, _RecordingRunner


def replay_impl(
    artifact: artifacts.Artifact | Path | str,
    *,
    impl: str | Adapter | None = None,
    pool: Any | None = None,
    times: int = 2,
) -> ReplayResult:
    """Re-run ``artifact``'s properties on its spec ``times`` times through ``impl`` (default:
    the artifact's ``impl``, else ``lce``); TP > 1 specs need ``pool``."""
    if times < 1:
        raise ValueError(f"times must be >= 1, got {times}")
    art = artifact if isinstance(artifact, artifacts.Artifact) else artifacts.load(artifact)
    adapter = resolve(impl or art.record.get("impl") or "lce")
    mutant = art.record.get("mutant")
    names = art.property_name.split(",")
    runs = []
    for _ in range(times):
        runner = _RecordingRunner(ImplPool(adapter, pool), mutant)
        runner.pool_for_tp1 = True  # TP = 1 cases too go through ImplPool, i.e. the adapter
        verdicts = check_case(art.spec, properties=names, runner=runner)
        records = [artifacts.verdict_record(v) for v in verdicts]
        runs.append(RunDigest(records, runner.digest.hexdigest()))
    return ReplayResult(art, art.spec, mutant, runs, artifacts.reference_sha256(art.spec))
