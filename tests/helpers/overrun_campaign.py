"""A campaign command (``python -m tests.helpers.overrun_campaign <verify run options>``) whose
search stops returning to Hypothesis once it has found a failure: the next example spins (as a
search stuck between examples does, where no deadline check runs) until a signal stops it. With
``LCE_TEST_DEAF=1`` the spinning search also ignores SIGTERM (as one stuck in a native call
would), so only a kill ends it. The graces are cut to ``LCE_TEST_GRACE_S`` seconds. Patched at
import, so the concurrent searches' spawned processes (which import this module) spin too."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from verify.running import concurrent_searches, engine, search, stopping

GRACE_S = float(os.environ.get("LCE_TEST_GRACE_S", "1"))
stopping.OVERRUN_GRACE_S = GRACE_S
concurrent_searches.STOP_GRACE_S = GRACE_S
_check_case = engine.check_case
_failed = False


def _spinning_check_case(spec: Any, **kwargs: Any) -> Any:
    """The real check until one has failed; every later call spins."""
    global _failed
    if _failed:
        if os.environ.get("LCE_TEST_DEAF") == "1":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(0.05)
    verdicts = _check_case(spec, **kwargs)
    _failed = any(v.failed for v in verdicts)
    return verdicts


engine.check_case = _spinning_check_case
# No landmark specs and no covering rows: a failing explicit example is not shrunk, and the stuck
# search this plants is one shrinking its failure.
search.landmarks_at = lambda *args, **kwargs: []
search.SliceSearch._covering_rows = lambda self, names, marks: []

if __name__ == "__main__":
    from verify.cli import main

    sys.exit(main(sys.argv[1:]))
