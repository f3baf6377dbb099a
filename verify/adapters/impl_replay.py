"""Replay a failure artifact through the implementation it names (its ``impl`` field).

`verify.results.replay.replay` with every run routed to the adapter; artifacts without ``impl``
replay on lce.
"""

from __future__ import annotations

from pathlib import Path

from verify.distributed.seam import Pool
from verify.execution.interface import Adapter
from verify.execution.selection import resolve
from verify.results import artifacts
from verify.results.replay import ReplayResult, replay


def replay_impl(
    artifact: artifacts.Artifact | Path | str,
    *,
    impl: str | Adapter | None = None,
    pool: Pool | None = None,
    times: int = 2,
) -> ReplayResult:
    """Re-run ``artifact``'s properties on its spec ``times`` times through ``impl`` (default:
    the artifact's ``impl``, else ``lce``); TP > 1 specs need ``pool``."""
    art = artifact if isinstance(artifact, artifacts.Artifact) else artifacts.load(artifact)
    adapter = resolve(impl or art.record.get("impl") or "lce")
    return replay(art, pool=pool, times=times, adapter=adapter)
