"""Where blocks sit in a device set, and which of them an engine with that set can reach.

An engine over a ``DeviceSet`` looks a block up only on the candidate devices
``DeviceSet.candidates`` picks for its key. A block on any other device is *unreachable*
for that set: it was stored before a device was added or removed (rendezvous hashing
changed its candidates), or the set given here is only part of the one the engines use. Reports count such blocks per
device; nothing deletes a block on that ground (the set given may be incomplete), and
gc treats them as any other block: no engine of the set reads them, so their access
times stop advancing and least-recently-accessed order reaches them early by itself.

With one device every block is reachable. The key is read from the block's name
(``<hex key>.kv``), which is what the engine looks up; a block whose header disagrees
with its name is fsck's ``misplaced`` problem, not this one.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from pykv.deviceset import DeviceSet
from pykv.maintenance.scan import Entry, Kind
from pykv.tree import BLOCK_SUFFIX


def block_key(path: str) -> bytes | None:
    """The key a block file is named by (None if the name is not ``<hex>.kv``)."""
    name = os.path.basename(path)
    if not name.endswith(BLOCK_SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:-len(BLOCK_SUFFIX)])
    except ValueError:
        return None


def reachable(devices: DeviceSet, index: int, path: str) -> bool:
    """Whether the block file at ``path`` on device ``index`` is where ``devices`` looks for it."""
    if len(devices) == 1:
        return True
    key = block_key(path)
    return key is not None and index in devices.candidates(key)


@dataclass
class DeviceShare:
    """One device's part of a set: its blocks, and how many of them the set cannot reach."""

    root: str
    id: str
    blocks: int = 0
    bytes: int = 0
    share: float = 0.0  # of the set's bytes
    unreachable_blocks: int = 0
    unreachable_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def device_shares(devices: DeviceSet, entries: Sequence[Iterable[Entry]]) -> list[DeviceShare]:
    """Per device (``entries[i]``: a scan of ``devices[i]``), its blocks, bytes, share and unreachable blocks."""
    shares = []
    for index, (tree, scanned) in enumerate(zip(devices, entries)):
        share = DeviceShare(str(tree.root), tree.identity)
        for entry in scanned:
            if entry.kind is not Kind.BLOCK:
                continue
            share.blocks += 1
            share.bytes += entry.size
            if not reachable(devices, index, entry.path):
                share.unreachable_blocks += 1
                share.unreachable_bytes += entry.size
        shares.append(share)
    total = sum(share.bytes for share in shares)
    for share in shares:
        share.share = round(share.bytes / total, 4) if total else 0.0
    return shares


