"""The values behind pykv's gauges (``pykv.counters.Gauge``): each device of the tree, as the
engine's eviction rounds find it.

No walk of its own: ``TreeEvictor`` scans every device each round anyway, and records
in ``DeviceGauges`` what the round left (blocks, their bytes, still over the limit or
not, when it ended); after a round, at most once a minute, it counts the device's
quarantine (``pykv.maintenance.quarantine``: a walk of ``.pykv/quarantine`` only, bounded). The
engine's step only takes a snapshot (``samples``: one lock, no I/O).

A value not known is NaN: before the first round, and always in an engine that runs no
rounds (no ``max_tree_bytes``, or ``store`` false). ``start_samples`` gives every gauge's
value at server start; ``device_info`` and the limit never change after it.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from pykv.counters import Gauge
from pykv.maintenance.quarantine import QuarantineUsage

NAN = math.nan


class GaugeSample(NamedTuple):
    """One gauge's value for one label set (label values in ``Gauge.labelnames`` order)."""

    gauge: Gauge
    labels: tuple[str, ...]
    value: float


def start_samples(roots: Sequence[str], limit: int) -> list[GaugeSample]:
    """Every gauge of every device at server start: ``device_info`` 1, the limit, not behind, the rest NaN."""
    samples = []
    for index, root in enumerate(roots):
        device = str(index)
        samples += [GaugeSample(Gauge.DEVICE_INFO, (device, str(root)), 1.0),
                    GaugeSample(Gauge.TREE_LIMIT_BYTES, (device,), float(limit))]
    return samples + DeviceGauges(len(roots)).samples()


@dataclass
class _Device:
    blocks: float = NAN
    bytes: float = NAN
    behind: bool = False
    round_ended: float | None = None  # on the gauges' clock
    quarantine_files: float = NAN
    quarantine_bytes: float = NAN


class DeviceGauges:
    """What the last round on each device found; the evictor's thread records, the scheduler reads.
    ``clock``: monotonic seconds (the rounds' age)."""

    def __init__(self, devices: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._devices = [_Device() for _ in range(devices)]

    def round_done(self, device: int, blocks: int, nbytes: int, behind: bool) -> None:
        """A round on ``device`` ended leaving ``blocks`` block files of ``nbytes``; ``behind``: over the limit."""
        with self._lock:
            state = self._devices[device]
            state.blocks, state.bytes, state.behind = float(blocks), float(nbytes), behind
            state.round_ended = self._clock()

    def quarantine_counted(self, device: int, usage: QuarantineUsage | None) -> None:
        """The device's quarantine as just counted (None: it could not be: NaN)."""
        with self._lock:
            state = self._devices[device]
            state.quarantine_files = NAN if usage is None else float(usage.files)
            state.quarantine_bytes = NAN if usage is None else float(usage.bytes)

    def samples(self) -> list[GaugeSample]:
        """The gauges that change while serving, per device, now (the age counts from each round's end)."""
        now = self._clock()
        out = []
        with self._lock:
            for index, state in enumerate(self._devices):
                device = (str(index),)
                age = NAN if state.round_ended is None else max(0.0, now - state.round_ended)
                out += [GaugeSample(Gauge.TREE_BYTES, device, state.bytes),
                        GaugeSample(Gauge.TREE_BLOCKS, device, state.blocks),
                        GaugeSample(Gauge.EVICT_BEHIND, device, float(state.behind)),
                        GaugeSample(Gauge.EVICT_ROUND_AGE, device, age),
                        GaugeSample(Gauge.QUARANTINE_BYTES, device, state.quarantine_bytes),
                        GaugeSample(Gauge.QUARANTINE_FILES, device, state.quarantine_files)]
        return out
