"""Pointer lists for batched copies between KV cache blocks and staging slots.

A batched copy op (vLLM's ``swap_blocks_batch``: one ``cuMemcpyBatchAsync`` on
CUDA 12.8+) moves many ``(source pointer, destination pointer, bytes)`` entries
in one driver call. ``copy_descriptors`` lists those entries for a batch of
``CopyTask``s; the same contract as ``TorchCopier`` (payload layout: see
``layout.BlockLayout``). Where a run of consecutive block ids lands in packed
KV rows (row stride equals the page bytes) the run is one entry, otherwise one
entry per block page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pykv.connector.layout import BlockLayout


@dataclass
class Descriptors:
    """Entries of one batched copy: ``src[i] -> dst[i]``, ``sizes[i]`` bytes (int64 arrays)."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    def __len__(self) -> int:
        return len(self.sizes)


def _runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start positions, lengths) of the runs of consecutive ids."""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    ends = np.concatenate((breaks, [len(ids)])).astype(np.int64)
    return starts, ends - starts


def copy_descriptors(tasks: Sequence, tensors: Sequence[torch.Tensor], layout: BlockLayout, *,
                     to_slot: bool) -> Descriptors:
    """The copy entries moving every byte of ``tasks`` (``CopyTask``) one way.

    ``to_slot``: KV rows -> slot payload (store); otherwise slot -> KV rows (load).
    """
    src_parts: list[np.ndarray] = []
    dst_parts: list[np.ndarray] = []
    size_parts: list[np.ndarray] = []
    bpc = layout.blocks_per_chunk
    for task in tasks:
        ids = np.asarray(task.gpu_ids, dtype=np.int64)
        if len(ids) == 0:
            continue
        assert len(ids) + task.skip <= bpc, "chunk larger than blocks_per_chunk"
        payload = task.payload.data_ptr()
        for ref, offset in zip(layout.groups[task.group], layout.offsets(task.group)):
            kv = tensors[ref.tensor]
            row_stride = kv.stride(0) * kv.element_size()
            page = ref.page_bytes
            first_row = payload + offset + task.skip * page  # the slot row of gpu_ids[0]
            if row_stride == page:  # packed rows: one entry per run of consecutive ids
                starts, counts = _runs(ids)
            else:
                starts, counts = np.arange(len(ids), dtype=np.int64), np.ones(len(ids), dtype=np.int64)
            slot_ptrs = first_row + starts * page
            kv_ptrs = kv.data_ptr() + ids[starts] * row_stride
            src_parts.append(kv_ptrs if to_slot else slot_ptrs)
            dst_parts.append(slot_ptrs if to_slot else kv_ptrs)
            size_parts.append(counts * page)
    if not size_parts:
        empty = np.zeros(0, dtype=np.int64)
        return Descriptors(empty, empty.copy(), empty.copy())
    return Descriptors(np.concatenate(src_parts).astype(np.int64), np.concatenate(dst_parts).astype(np.int64),
                       np.concatenate(size_parts).astype(np.int64))
