"""Worker-side jobs for the campaign's fault tests: a rank process that dies mid-case."""

from __future__ import annotations

import os
from typing import Any


def die(payload: dict[str, Any], ctx: Any) -> None:
    """Every rank exits at once, as a segfaulting kernel would take its process down."""
    os._exit(3)
