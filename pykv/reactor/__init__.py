"""The reactor: one thread that owns the I/O backend and carries out the policy's actions.

``core`` holds the ``Reactor`` (thread, inbox, policy steps, dispatch of completions); it hands
the steps to two collaborators, ``loads.Loads`` and ``stores.Stores``, which share a
``context.ReactorContext`` (backend, pool, medium, policy, verifier, transfers, stats); ``types``
is what clients exchange with it; ``verify`` its hashing threads. The public names are
re-exported here: ``from pykv.reactor import Reactor, LoadBlock, ...``.
"""

from pykv.reactor.core import Reactor
from pykv.reactor.types import (STATS, FillRequest, JobResult, LoadBlock, LoadSink, ReactorConfig, ReadyBlock,
                                StoreBlock, StoreSource, backend_depth, segment_count, slot_header)

__all__ = ["STATS", "FillRequest", "JobResult", "LoadBlock", "LoadSink", "Reactor", "ReactorConfig", "ReadyBlock",
           "StoreBlock", "StoreSource", "backend_depth", "segment_count", "slot_header"]
