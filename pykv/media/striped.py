"""The striped medium: one cache over several devices, each block on exactly one of them.

``StripedMedium`` composes one leaf medium per device of a ``DeviceSet``: ``locate`` and
``contains`` go to the device the set's rendezvous hashing chooses for the key, every
other call to the device whose root holds the location. Each device is one *lane*: the
reactor bounds the I/O in flight per lane, so a slow device does not starve the others.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from pykv.deviceset import DeviceSet
from pykv.media.base import Medium, OpenSpec, WriteTarget


class StripedMedium(Medium):
    """``media[i]`` holds the blocks ``devices.index_of`` places on device ``i``."""

    name = "striped"

    def __init__(self, devices: DeviceSet, media: Sequence[Medium]) -> None:
        if len(media) != len(devices):
            raise ValueError(f"{len(media)} media for {len(devices)} devices")
        self.devices, self.media = devices, tuple(media)
        # longest first: the first root whose prefix a location has is its own (roots never nest)
        self._prefixes = sorted(((os.path.join(os.fspath(root), ""), i) for i, root in enumerate(devices.roots)),
                                key=lambda item: -len(item[0]))

    @property
    def lanes(self) -> int:
        return len(self.media)

    def lane(self, location: Path) -> int:
        text = os.fspath(location)
        for prefix, index in self._prefixes:
            if text.startswith(prefix):
                return index
        raise ValueError(f"{text} is on none of the devices")

    @property
    def opens_direct(self) -> bool:
        return all(medium.opens_direct for medium in self.media)

    @property
    def sync_before_publish(self) -> bool:
        return self.media[0].sync_before_publish

    def locate(self, namespace_id: str, key: bytes) -> Path:
        return self.media[self.devices.index_of(key)].locate(namespace_id, key)

    def contains(self, namespace_id: str, key: bytes) -> bool:
        return self.media[self.devices.index_of(key)].contains(namespace_id, key)

    def touch(self, location: Path) -> bool:
        return self._of(location).touch(location)

    def open_for_read(self, location: Path) -> OpenSpec:
        return self._of(location).open_for_read(location)

    def check_opened(self, fd: int) -> int:
        return self.media[0].check_opened(fd)  # the set opens every device alike (``open_set_medium``)

    def prepare_write(self, location: Path) -> WriteTarget:
        return self._of(location).prepare_write(location)

    def publish(self, temp: Path, location: Path) -> bool:
        return self._of(location).publish(temp, location)

    def abandon(self, temp: Path) -> None:
        self._of(temp).abandon(temp)

    def quarantine(self, location: Path, run: str) -> Path:
        return self._of(location).quarantine(location, run)

    def _of(self, location: Path) -> Medium:
        return self.media[self.lane(location)]
