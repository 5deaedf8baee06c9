"""The medium a device set's blocks live on, and what follows from it: O_DIRECT and the I/O engine.

Every medium is opened by its name through the registry (``pykv.media.open_medium``): one
device is its ``"posix"`` medium, several are ``"striped"`` over one ``"posix"`` medium per
device. The store's reactor (``pykv.store.build_reactor``, which ``pykv bench`` calls too) and
``benchmarks/placement_balance.py`` open it here.
"""

from __future__ import annotations

import logging

from pykv.deviceset import DeviceSet
from pykv.io.probe import direct_io_supported
from pykv.media import Medium, open_medium

log = logging.getLogger(__name__)

LEAF_MEDIUM = "posix"
"""The medium of each device (a tree on a local or mounted filesystem)."""

SET_MEDIUM = "striped"
"""The medium over several devices, composed of one leaf medium per device."""


def open_store_medium(devices: DeviceSet, *, direct: bool = False) -> Medium:
    """The medium blocks live on; ``direct``: O_DIRECT I/O.
    One device: its leaf medium; several: the set medium over one leaf per device."""
    leaves = [open_medium(LEAF_MEDIUM, tree, direct=direct) for tree in devices]
    return leaves[0] if len(leaves) == 1 else open_medium(SET_MEDIUM, devices, media=leaves)


def devices_take_direct(devices: DeviceSet) -> bool:
    """Whether every device takes O_DIRECT (a set opens all alike: one that does not makes all buffered)."""
    for tree in devices:
        direct, why = direct_io_supported(tree.root)
        if not direct:
            log.info("pykv: %s does not take O_DIRECT (%s); using buffered I/O", tree.root, why)
            return False
    return True


def io_engine_for(io_engine: str, medium: Medium) -> str:
    """``io_engine`` with ``auto`` settled for ``medium``: io_uring where it reads with O_DIRECT, the
    thread pool on a buffered medium. A buffered read of cached pages is a CPU copy that never
    sleeps, so io_uring runs all of them on one thread (inline, or on one io-wq worker, which adds
    workers only when one blocks), where the pool copies on all of its threads (docs/benchmarks.md)."""
    if io_engine != "auto" or medium.opens_direct:
        return io_engine
    log.info("pykv: buffered I/O (no O_DIRECT on the medium): io_engine auto uses the thread pool")
    return "threadpool"
