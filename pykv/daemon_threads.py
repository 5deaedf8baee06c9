"""A device's few daemon threads, started on its first call; the thread limit is no error.

``pykv.lanes`` (the scheduler's lookups) and ``pykv.reactor.fileops`` (the medium's metadata
calls) give each device its own threads. Daemons, so that a process whose mount hangs can still
exit; and when the process may start no more threads, those already started serve the device.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


def start_daemon_threads(target: Callable[[], None], count: int, name: str) -> list[threading.Thread]:
    """Up to ``count`` started daemon threads running ``target``, named ``{name}-0``, ``{name}-1``, ...

    Stops at the first thread the process refuses (its thread limit), with a warning; empty when
    none could be started, which the caller answers as it would a closed device."""
    started: list[threading.Thread] = []
    for number in range(count):
        thread = threading.Thread(target=target, name=f"{name}-{number}", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # the process's thread limit: the threads started so far serve
            log.warning("pykv: thread %s not started (%s)", thread.name, exc)
            break
        started.append(thread)
    return started
