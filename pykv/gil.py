"""The engine process's GIL switch interval (``gil_switch_ms``).

A thread that gives the GIL up (every torch op, each zstd or numpy call, each wait) takes it
back only when the holder gives it up too; a thread running Python without pause (vLLM's engine
loop while requests wait for their KV) gives it up once per switch interval (5 ms by default),
so a pykv thread issuing many short calls waits up to an interval for each one.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger(__name__)


def apply_switch_interval(ms: float | None) -> None:
    """Set the interpreter's switch interval to ``ms`` milliseconds (None: leave it as it is);
    one log line when it changes."""
    if ms is None:
        return
    before = sys.getswitchinterval()
    if abs(before - ms / 1e3) < 1e-9:
        return
    sys.setswitchinterval(ms / 1e3)
    log.info("pykv: GIL switch interval %g ms (was %g ms; gil_switch_ms)", ms, before * 1e3)
