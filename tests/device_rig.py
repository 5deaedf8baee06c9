"""The device codec tests' shared rig: CPU KV tensors, a block's raw payload as the plain copier
gathers it, one coded load run to its end, and ``Ends`` (the ``done`` calls in order)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from pykv.connector.copier import CopyTask, TorchCopier
from pykv.connector.device_codec import CodedLoad
from pykv.connector.layout import BlockLayout


class Ends:
    """Every ``done`` call, in order; ``wait`` for a count (the threaded path ends later)."""

    def __init__(self) -> None:
        self.calls, self.cond = [], threading.Condition()

    def __call__(self, task, ok, extra) -> None:
        with self.cond:
            self.calls.append((task, ok, extra))
            self.cond.notify_all()

    def wait(self, count: int) -> list:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.calls) >= count, timeout=10), self.calls
            return list(self.calls)


def kv_tensors(num_blocks: int, page: int, scales=(0.05, 0.05), seed: int = 0) -> list[torch.Tensor]:
    """One bf16 KV tensor per scale (``num_blocks`` pages of ``page`` bytes, as int8 views)."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(num_blocks, page // 2, generator=generator) * scale).to(torch.bfloat16).view(torch.int8)
            for scale in scales]


def gathered(layout: BlockLayout, raw: int, tensors, ids, skip: int = 0) -> bytes:
    """The block's raw payload, as the plain copier puts it into a slot."""
    slot = torch.zeros(raw, dtype=torch.int8)
    TorchCopier(tensors, layout).to_slots([CopyTask(slot, 0, np.asarray(ids), skip)], lambda t, ok: None)
    return slot.numpy().tobytes()


def coded_load(device, stored: bytes, ids, raw: int, params: str, skip: int = 0):
    """``stored`` loaded by ``device`` into blocks ``ids``: (ok, failure, the slot it came from)."""
    slot = torch.frombuffer(bytearray(stored), dtype=torch.int8)
    ends = Ends()
    device.load([CodedLoad(CopyTask(slot, 0, np.asarray(ids), skip), raw, params)], ends)
    [(_, ok, failure)] = ends.wait(1)
    return ok, failure, slot


def coded_loads(blocks, raw: int, params: str, skip: int = 0) -> tuple[list[CodedLoad], Ends]:
    """One ``CodedLoad`` for each (stored bytes, gpu ids) of ``blocks`` (its task's ``token``: its
    index), and one ``Ends`` for them all."""
    loads = [CodedLoad(CopyTask(torch.frombuffer(bytearray(stored), dtype=torch.int8), 0, np.asarray(ids), skip,
                                token=i), raw, params) for i, (stored, ids) in enumerate(blocks)]
    return loads, Ends()
