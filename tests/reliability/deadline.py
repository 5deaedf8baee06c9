"""``deadline``: fail a test body that blocks (a FIFO, a device) instead of hanging the suite."""

from __future__ import annotations

import contextlib
import signal


@contextlib.contextmanager
def deadline(seconds: int):
    """Raise ``TimeoutError`` in the body when it blocks longer than ``seconds`` (main thread only)."""
    def expired(signum, frame):
        raise TimeoutError(f"still blocked after {seconds}s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
