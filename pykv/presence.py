"""Which blocks are published on a device set, asked of each device within a deadline.

The scheduler's view of the disk: a key is on disk when every rank's file of it is published
on one of its candidate devices (each rank places its own shard). The candidates are asked
in rounds, first choices first, so a block costs the ``lstat``s a sequential search would;
every call runs on its device's threads (``pykv.lanes``), so a stalled mount costs one round
at most the deadline, once, and then answers at once: such a key is *unknown* (``None``), which the
caller treats as a miss (and does not store). Where each file was found is remembered for
the access stamps of a load that follows.
"""

from __future__ import annotations

from typing import Sequence

from pykv.deviceset import DeviceSet
from pykv.lanes import LaneCalls

MAX_HOLDERS = 1 << 16
"""Holders remembered for stamps at most (the map starts over beyond it)."""
STAMP_BATCH = 8
"""Files stamped per call on a device's thread: one call per file cost a load beside it twice what
the stamps' own system calls do (``docs/benchmarks.md``); at a millisecond per stamp (a slow
shared mount) a batch this short runs under half of a lookup deadline of 16 ms or more, so it
does not make its device look stalled to the existence checks."""

Block = tuple[int, str, bytes]  # (device, namespace id, key)
StampBatch = tuple[int, tuple[tuple[str, bytes], ...]]  # (device, its (namespace id, key)s)


def find_holders(devices: DeviceSet, calls: LaneCalls, blocks: Sequence[tuple[str, bytes]]
                 ) -> tuple[dict[tuple[str, bytes], int], set[tuple[str, bytes]]]:
    """Ask each ``(namespace id, key)``'s candidate devices in rounds, first choices first, each on its
    device's threads (``calls``, within their deadline): the device found holding each block, and
    the blocks a candidate did not answer for (unknown unless another candidate held them)."""
    held: dict[tuple[str, bytes], int] = {}
    unknown: set[tuple[str, bytes]] = set()
    pending, position = list(dict.fromkeys(blocks)), 0

    def contains(block: Block) -> bool:  # on the device's thread
        device, ns, key = block
        return devices[device].contains(ns, key)

    while pending:
        asked = [(ns, key, choices[position]) for ns, key in pending
                 if position < len(choices := devices.candidates(key))]
        answers = calls.run(contains, [(device, (device, ns, key)) for ns, key, device in asked])
        for (ns, key, device), answer in zip(asked, answers):
            if answer:
                held[ns, key] = device
            elif answer is None:
                unknown.add((ns, key))
        pending = [(ns, key) for ns, key, _ in asked if (ns, key) not in held]
        position += 1
    return held, unknown


class DiskPresence:
    """Existence checks and access stamps of blocks over ``devices`` for ``namespaces`` (one per rank)."""

    def __init__(self, devices: DeviceSet, namespaces: Sequence[str], deadline: float) -> None:
        self.devices, self.namespaces = devices, tuple(namespaces)
        self.calls = LaneCalls(len(devices), deadline)
        self._holders: dict[tuple[str, bytes], int] = {}

    @property
    def unanswered(self) -> int:
        """Checks that got no answer in time, since the start."""
        return self.calls.unanswered

    def find(self, keys: Sequence[bytes]) -> list[bool | None]:
        """For each key: True when every rank's file is published, False when one rank's is on none of
        its candidates, else None (a device did not answer in time and no other candidate held it)."""
        held, unknown = find_holders(self.devices, self.calls,
                                     [(ns, key) for key in keys for ns in self.namespaces])
        for (ns, key), device in held.items():
            self._remember(ns, key, device)
        return [_verdict([(ns, key) in held for ns in self.namespaces],
                         [(ns, key) in unknown for ns in self.namespaces]) for key in keys]

    def stamp(self, keys: Sequence[bytes]) -> int:
        """Stamp every rank's file of these keys as used now (gc and eviction recency), on their devices'
        threads without waiting, ``STAMP_BATCH`` files per call; a stalled device skips its stamps.
        Returns how many files were queued."""
        per_device: dict[int, list[tuple[str, bytes]]] = {}
        for key in keys:
            for ns in self.namespaces:
                device = self._holders.get((ns, key))
                if device is None:
                    device = self.devices.candidates(key)[0]
                per_device.setdefault(device, []).append((ns, key))
        queued = 0
        for device, files in per_device.items():
            for start in range(0, len(files), STAMP_BATCH):
                batch = tuple(files[start:start + STAMP_BATCH])
                queued += len(batch) * self.calls.start(self._stamp_batch, [(device, (device, batch))])
        return queued

    def close(self, timeout: float = 1.0) -> bool:
        return self.calls.close(timeout)

    # -- on the devices' threads ----------------------------------------------------------------------
    def _stamp_batch(self, batch: StampBatch) -> None:
        device, files = batch
        tree = self.devices[device]
        for ns, key in files:
            try:
                tree.stamp(ns, key)
            except OSError:  # one file's stamp failing (permissions, a racing gc) skips that file only
                continue

    # -- bookkeeping -----------------------------------------------------------------------------
    def _remember(self, ns: str, key: bytes, device: int) -> None:
        if len(self._holders) >= MAX_HOLDERS:
            self._holders.clear()
        self._holders[ns, key] = device


def _verdict(found: list[bool], unknown: list[bool]) -> bool | None:
    """A key's answer from its ranks': every file found, one surely missing, or not known."""
    if all(found):
        return True
    if any(not f and not u for f, u in zip(found, unknown)):
        return False
    return None
