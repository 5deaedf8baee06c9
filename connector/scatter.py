"""Loads whose GPU blocks are out of order: one bulk copy per slot, then a scatter on the device.

vLLM hands a request the blocks earlier requests freed, and its free queue returns them in
descending order, so consecutive sub-blocks of a storage block rarely sit in consecutive GPU
blocks. Copied straight from the slot, each (sub-block, layer) is then its own copy entry: 443
entries per 28 MiB block of the 3B shape against 33 in ascending order, and the batched copy's
per-entry cost, not the bytes, sets the load's pace (docs/benchmarks.md, run 16). ``ScatterLoads``
instead copies each slot's payload whole into a device scratch buffer (one entry per slot) and
moves the rows into the KV cache with two device kernels per layer and batch (a gather and an
``index_copy_``), whatever the order. Same contract and bytes as ``TorchCopier``'s loads; the
scratch is a bounded ring of ``slots`` payloads, reused in stream order.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from pykv.connector.layout import BlockLayout

SCATTER_MIN_RUNS = 4
"""A batch goes through the scratch when its tasks average at least this many runs of consecutive
GPU block ids (one run per task: ascending, straight from the slot is as cheap)."""

BulkCopy = Callable[[list[tuple[torch.Tensor, torch.Tensor]]], object]
"""Copies each (slot payload, scratch region) pair, queued on the current stream; returns what must
live until the stream has run the copies."""


def id_runs(tasks: Sequence) -> int:
    """Runs of consecutive GPU block ids over ``tasks`` (one per task at least)."""
    return sum(1 + int(np.count_nonzero(np.diff(np.asarray(t.gpu_ids, dtype=np.int64)) != 1))
               for t in tasks if len(t.gpu_ids))


def worth_scattering(tasks: Sequence) -> bool:
    """Whether ``tasks``' copies straight from their slots would be fragmented enough to go through
    the scratch instead (``SCATTER_MIN_RUNS``)."""
    loaded = [t for t in tasks if len(t.gpu_ids)]
    return bool(loaded) and id_runs(loaded) >= SCATTER_MIN_RUNS * len(loaded)


class ScatterLoads:
    """The scratch ring and the scatter of one load batch (see the module docstring)."""

    def __init__(self, tensors: Sequence[torch.Tensor], layout: BlockLayout, *, slots: int,
                 bulk_copy: BulkCopy | None = None) -> None:
        self.tensors, self.layout = list(tensors), layout
        self.payload_bytes = max(layout.geometry(g).payload_length for g in range(len(layout.groups)))
        self.slots = max(1, slots)
        self._bulk_copy = bulk_copy or copy_each
        self._scratch: torch.Tensor | None = None

    def scratch(self) -> torch.Tensor:
        """The device scratch (``slots`` payloads), allocated on first use: raises what the allocator
        raises (out of device memory) so that the caller can copy straight instead."""
        if self._scratch is None:
            self._scratch = torch.empty(self.slots * self.payload_bytes, dtype=torch.int8,
                                        device=self.tensors[0].device)
        return self._scratch

    def issue(self, tasks: Sequence) -> list:
        """Queue every byte of ``tasks`` (loads) on the current stream; returns what must live until
        the stream has run it (the bulk copies' pointer lists, the index tensors)."""
        keep: list = []
        scratch = self.scratch()
        loaded = [t for t in tasks if len(t.gpu_ids)]
        for group in sorted({t.group for t in loaded}):
            members = [t for t in loaded if t.group == group]
            for start in range(0, len(members), self.slots):
                keep += self._round(group, members[start:start + self.slots], scratch)
        return keep

    def _round(self, group: int, members: Sequence, scratch: torch.Tensor) -> list:
        """Up to ``slots`` tasks of one group: their payloads into the scratch, then per ref one
        gather of their rows and one ``index_copy_`` into the KV tensor."""
        payload = self.layout.geometry(group).payload_length
        size = self.payload_bytes
        copied = self._bulk_copy([(t.payload[:payload], scratch[i * size:i * size + payload])
                                  for i, t in enumerate(members)])
        counts = np.array([len(t.gpu_ids) for t in members], dtype=np.int64)
        which = np.repeat(np.arange(len(members), dtype=np.int64), counts)  # task of each row
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        rows = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
        rows += np.repeat(np.array([t.skip for t in members], dtype=np.int64), counts)
        ids = np.concatenate([np.asarray(t.gpu_ids, dtype=np.int64) for t in members])
        device = scratch.device
        which_d, rows_d, ids_d = (torch.from_numpy(a).to(device, non_blocking=True) for a in (which, rows, ids))
        bpc = self.layout.blocks_per_chunk
        for ref, offset in zip(self.layout.groups[group], self.layout.offsets(group)):
            pages = scratch.as_strided((len(members), bpc, ref.page_bytes), (size, ref.page_bytes, 1),
                                       scratch.storage_offset() + offset)
            kv = self.tensors[ref.tensor]
            if kv.shape[1] != ref.page_bytes:
                kv = kv.narrow(1, 0, ref.page_bytes)
            kv.index_copy_(0, ids_d, pages[which_d, rows_d])
        return [copied, which_d, rows_d, ids_d]


def copy_each(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each (source, target) pair as one torch copy on the current stream (no batched op)."""
    for source, target in pairs:
        target.copy_(source, non_blocking=True)
