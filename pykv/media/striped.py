"""The striped medium: one cache over several devices, each block on exactly one of them.

``StripedMedium`` composes one leaf medium per device of a ``DeviceSet``: ``locate`` and
``contains`` check the key's candidate devices (``DeviceSet.candidates``), ``place``
spreads a store's blocks over their candidates (below), every other call goes to the
device whose root holds the location. Each device is one *lane*: the reactor bounds the
I/O in flight per lane, so a slow device does not starve the others.

Why choices: with the top rendezvous score alone a request's blocks land on the devices
as a random draw, and its load lasts as long as the busiest device's share. ``place``
counts each device's blocks among this store's and the ``RECENT_PER_DEVICE`` x N placed
before it (a request's earlier store jobs, which its load reads together with this one),
puts each block on its least counted candidate, then moves blocks along chains (each to
another of its candidates) while that takes one off the busiest device. Figures:
docs/benchmarks.md (run 17), ``benchmarks/placement_balance.py``. A block already on one of
its candidates is stored there again (a store never leaves a second copy that a lookup
would not see first); two engines storing one block at once may leave one copy on each of
two candidates, both sound.
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path
from typing import Sequence

from pykv.deviceset import DeviceSet
from pykv.media.base import Medium, OpenSpec, WriteTarget


RECENT_PER_DEVICE = 80
"""Blocks per device of the window of earlier placements ``place`` evens out with (640 on 8
devices: two 80k-token requests')."""


class StripedMedium(Medium):
    """``media[i]`` holds the blocks placed on device ``i`` of ``devices``."""

    name = "striped"

    def __init__(self, devices: DeviceSet, media: Sequence[Medium]) -> None:
        if len(media) != len(devices):
            raise ValueError(f"{len(media)} media for {len(devices)} devices")
        self.devices, self.media = devices, tuple(media)
        self._recent: deque[int] = deque(maxlen=RECENT_PER_DEVICE * len(media))  # devices of the latest blocks
        self._placing = threading.Lock()

    @property
    def lanes(self) -> int:
        return len(self.media)

    def lane(self, location: Path) -> int:
        return self.devices.device_of(location)

    def first_lane(self, namespace_id: str, key: bytes) -> int:
        return self.devices.candidates(key)[0]

    @property
    def opens_direct(self) -> bool:
        return all(medium.opens_direct for medium in self.media)

    @property
    def sync_before_publish(self) -> bool:
        return self.media[0].sync_before_publish

    def locate(self, namespace_id: str, key: bytes) -> Path:
        """The first candidate holding the block (the first candidate when none does)."""
        choices = self.devices.candidates(key)
        index = self.devices.holding(namespace_id, key, choices=choices, on=self.media)
        return self.media[choices[0] if index is None else index].locate(namespace_id, key)

    def contains(self, namespace_id: str, key: bytes) -> bool:
        return self.devices.holding(namespace_id, key, on=self.media) is not None

    def place(self, namespace_id: str, keys: Sequence[bytes]) -> list[Path]:
        """Each block on its candidate holding it already; the others each on the candidate least
        used by these blocks and the recent ones, then moved while the busiest device can shed one
        (``_shed_one``)."""
        held = [self.devices.holding(namespace_id, key, on=self.media) for key in keys]  # outside the lock
        return self.place_held(namespace_id, keys, held)

    def locate_on(self, lane: int, namespace_id: str, key: bytes) -> Path:
        return self.media[lane].locate(namespace_id, key)

    def place_held(self, namespace_id: str, keys: Sequence[bytes], held: Sequence[int | None]) -> list[Path]:
        candidates = [self.devices.candidates(key) for key in keys]
        chosen, options = [], []
        with self._placing:
            used = [0] * len(self.media)
            for index in self._recent:
                used[index] += 1
            for choices, index in zip(candidates, held):
                if index is None:
                    index = min(choices, key=used.__getitem__)
                    options.append((len(chosen), choices))
                chosen.append(index)
                used[index] += 1
            while _shed_one(chosen, options, used):
                pass
            self._recent.extend(chosen)
        return [self.media[index].locate(namespace_id, key) for index, key in zip(chosen, keys)]

    def touch(self, location: Path) -> bool:
        return self._of(location).touch(location)

    def open_for_read(self, location: Path) -> OpenSpec:
        return self._of(location).open_for_read(location)

    def check_opened(self, fd: int) -> int:
        return self.media[0].check_opened(fd)  # the set opens every device alike (``build.open_store_medium``)

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


def _shed_one(chosen: list[int], options: list[tuple[int, tuple[int, ...]]], used: list[int]) -> bool:
    """Move one block off the busiest device: along a chain of movable blocks (each to another of
    its candidates) to a device holding at least two fewer. ``options``: (position in ``chosen``,
    candidates) of the blocks that may move; ``chosen`` and ``used`` are updated. False when no such
    chain exists. Each move lowers the counts' sum of squares, so repeating it ends."""
    busiest = max(range(len(used)), key=used.__getitem__)
    via: dict[int, tuple[int, int] | None] = {busiest: None}  # device -> (block moved in, from device)
    frontier = [busiest]
    while frontier:
        device = frontier.pop(0)
        for position, choices in options:
            if chosen[position] != device:
                continue
            for target in choices:
                if target in via:
                    continue
                via[target] = (position, device)
                if used[target] + 2 <= used[busiest]:
                    used[target] += 1
                    used[busiest] -= 1
                    while via[target] is not None:  # each block of the chain one step on
                        position, source = via[target]
                        chosen[position] = target
                        target = source
                    return True
                frontier.append(target)
    return False
