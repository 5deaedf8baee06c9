"""Where a worker's job finds each block (loads) or puts it (stores), with no file-system call on
the caller's thread.

Over several devices a load needs each block's device before the reactor sees it, and a store
whether one of a block's candidates holds it already (``Medium.place_held``): an ``lstat`` per
candidate. ``BlockStore`` is called on vLLM's model-runner thread, so those checks run here on
each device's own threads (``pykv.lanes``), in rounds over the candidates as the scheduler's
``pykv.presence`` asks them, answered within ``lookup_deadline``: a stalled mount costs a job the
deadline once, then answers at once. A block that no answering candidate holds while another
did not answer is *unknown*: a load fails it (``UNANSWERED``, recomputed), a store leaves it
unstored. One device: no check at all (``locate`` and ``place`` make no I/O there; a read of a
missing block fails its open).
"""

from __future__ import annotations

import errno
from collections import Counter
from pathlib import Path
from typing import Sequence

from pykv.counters import WorkerCounter as C
from pykv.deviceset import DeviceSet
from pykv.failures import BlockFailure, Step
from pykv.lanes import LaneCalls
from pykv.media.base import Medium
from pykv.presence import find_holders

MISSING = BlockFailure(Step.OPEN, errno.ENOENT, "on none of its devices")
UNANSWERED = BlockFailure(Step.STALL, detail="its device did not answer within lookup_deadline (a stalled mount?)")


class BlockHolders:
    """The devices holding blocks of one namespace on ``medium`` (over ``devices``), asked within
    ``deadline``; see the module docstring. ``counters``: the worker's (``blocks_unanswered``)."""

    def __init__(self, medium: Medium, devices: DeviceSet, namespace_id: str, deadline: float,
                 counters: Counter[str]) -> None:
        self.medium, self.devices, self.namespace_id, self.counters = medium, devices, namespace_id, counters
        self.calls = LaneCalls(len(devices), deadline) if medium.lanes > 1 else None

    def readable(self, keys: Sequence[bytes], *, find: bool = True) -> tuple[list[Path], dict[int, BlockFailure]]:
        """For a load: the locations of the blocks before the first without a known holder, and the
        failures of that one (``MISSING``: no candidate holds it; ``UNANSWERED``) and of every later one
        (its own, or that first one's: vLLM recomputes from the first failed block on, so none is read).
        ``find=False`` (blocks in DRAM-tier slots): each on its first candidate, no lookup, none failed."""
        if self.calls is None:
            return [self.medium.locate(self.namespace_id, key) for key in keys], {}
        if not find:
            return [self.medium.locate_on(self.medium.first_lane(self.namespace_id, k), self.namespace_id, k)
                    for k in keys], {}
        found = self._find(keys)
        first = next((i for i, held in enumerate(found) if not isinstance(held, int)), len(found))
        failed = {i: found[i] if not isinstance(found[i], int) else found[first] for i in range(first, len(found))}
        self.counters[C.BLOCKS_UNANSWERED] += sum(failure is UNANSWERED for failure in failed.values())
        return [self.medium.locate_on(found[i], self.namespace_id, keys[i]) for i in range(first)], failed

    def writable(self, keys: Sequence[bytes]) -> tuple[list[Path], dict[int, BlockFailure]]:
        """For a store: where each block is written (``Medium.place``), in order, but for the blocks
        left unstored (``UNANSWERED``: a candidate that might hold it did not answer), returned apart."""
        if self.calls is None:
            return list(self.medium.place(self.namespace_id, keys)), {}
        found = self._find(keys)
        known = [i for i, held in enumerate(found) if held is not UNANSWERED]
        paths = self.medium.place_held(self.namespace_id, [keys[i] for i in known],
                                       [found[i] if isinstance(found[i], int) else None for i in known])
        self.counters[C.BLOCKS_UNANSWERED] += len(found) - len(known)
        return paths, {i: UNANSWERED for i, held in enumerate(found) if held is UNANSWERED}

    def _find(self, keys: Sequence[bytes]) -> list[int | BlockFailure]:
        """Each key's holder (the first candidate found holding it), or ``MISSING`` / ``UNANSWERED``
        (several devices only)."""
        ns = self.namespace_id
        held, unknown = find_holders(self.devices, self.calls, [(ns, key) for key in keys])
        return [held[ns, key] if (ns, key) in held else UNANSWERED if (ns, key) in unknown else MISSING
                for key in keys]

    def close(self, timeout: float = 0.0) -> bool:
        """Stop the devices' threads (False: a check still hangs on its daemon thread)."""
        return self.calls is None or self.calls.close(timeout)
