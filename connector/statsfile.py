"""Optional JSON dump of pykv's own counters, for tests and debugging.

When the environment variable ``PYKV_STATS_FILE`` is set, each pykv process
(scheduler-side manager, each worker rank) rewrites ``$PYKV_STATS_FILE.<role>.json``
atomically whenever its counters change. vLLM has no channel for worker-side
counters, and in vLLM's default multiprocess mode neither side runs in the
caller's process, so this is how an end-to-end test sees what really happened.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

ENV = "PYKV_STATS_FILE"


class StatsFile:
    """Writes counters for ``role`` ("scheduler", "worker0", ...) when ``PYKV_STATS_FILE`` is set."""

    def __init__(self, role: str) -> None:
        base = os.environ.get(ENV)
        self.path = f"{base}.{role}.json" if base else None
        self._last: dict | None = None

    @property
    def enabled(self) -> bool:
        """Whether counters are written at all (callers skip gathering them otherwise)."""
        return self.path is not None

    def write(self, counters: Mapping[str, object]) -> None:
        if self.path is None or counters == self._last:
            return
        self._last = dict(counters)
        temp = f"{self.path}.tmp.{os.getpid()}"
        with open(temp, "w") as f:
            json.dump(self._last, f, sort_keys=True)
        os.replace(temp, self.path)
