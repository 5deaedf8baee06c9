"""What the reactor's load and store steps share with it (reactor thread only): the resources they
act through and the bookkeeping of the transfers in progress.

The ``Reactor`` builds one ``ReactorContext`` and hands it to its ``Loads`` and ``Stores``; each of
them says in its docstring which of these it uses.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from pykv.failures import BlockFailure
from pykv.io.backend import IoBackend, IoRequest, OpKind
from pykv.media.base import Medium
from pykv.policy import ReactorPolicy
from pykv.reactor.fileops import FileCalls
from pykv.reactor.types import Awaiting, TransferState
from pykv.reactor.verify import PayloadVerifier
from pykv.staging import StagingPool

log = logging.getLogger(__package__)  # "pykv.reactor": one logger for the whole reactor


@dataclass
class ReactorContext:
    """The reactor thread's shared state. ``post(command)`` runs ``command`` on the reactor thread
    (the verifier threads report through it); ``hashing`` counts the blocks on the verifier
    threads (their slots must outlive the hashing; the reactor stops only when it is 0); ``files``
    makes the medium's blocking calls on each device's threads (the reactor stops only when none
    of them is pending)."""

    backend: IoBackend
    pool: StagingPool
    medium: Medium
    policy: ReactorPolicy
    verifier: PayloadVerifier
    post: Callable[[Callable[[], None]], None]
    files: FileCalls
    stats: Counter[str]
    transfers: dict[int, TransferState] = field(default_factory=dict)
    hashing: int = 0
    last_id: int = 0

    def add_transfer(self, t: TransferState) -> int:
        """Register ``t`` under a new transfer id (ids are never reused) and return the id."""
        self.last_id += 1
        self.transfers[self.last_id] = t
        return self.last_id

    def close(self, t: TransferState) -> None:
        """Close the transfer's file, if it has one open (nobody waits for the close)."""
        if t.fd >= 0:
            self.backend.submit([IoRequest(OpKind.CLOSE, (Awaiting.CLOSE, None), fd=t.fd)])
            t.fd = -1

    def fail(self, t: TransferState, failure: BlockFailure) -> None:
        """Record a failed block. Expected failures (a miss, a full or read-only disk) log at
        debug level: clients report them once per interval; anything else is a warning."""
        t.job.result.failed[t.index] = failure
        log.log(logging.DEBUG if failure.expected else logging.WARNING, "%s: %s", t.block.path, failure)
