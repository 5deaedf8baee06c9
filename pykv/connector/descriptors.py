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


def copy_descriptors(tasks: Sequence, tensors: Sequence[torch.Tensor], layout: BlockLayout, *,
                     to_slot: bool) -> Descriptors:
    """The copy entries moving every byte of ``tasks`` (``CopyTask``) one way.

    ``to_slot``: KV rows -> slot payload (store); otherwise slot -> KV rows (load).
    Vectorised over all blocks of a KV group, one pass per canonical ref: an 80k-token
    load of a model with 28 per-layer KV tensors is 5,120 blocks x 28 refs, and a Python
    loop per (block, ref) alone cost more than the copy.
    """
    src: list[np.ndarray] = []
    dst: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    groups: dict[int, list] = {}
    for task in tasks:
        if len(task.gpu_ids):
            assert len(task.gpu_ids) + task.skip <= layout.blocks_per_chunk, "chunk larger than blocks_per_chunk"
            groups.setdefault(task.group, []).append(task)
    for group, members in groups.items():
        ids = np.concatenate([np.asarray(t.gpu_ids, dtype=np.int64) for t in members])
        counts = np.array([len(t.gpu_ids) for t in members], dtype=np.int64)
        task_starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        payloads = np.repeat(np.array([t.payload.data_ptr() for t in members], dtype=np.int64), counts)
        rows = np.arange(len(ids), dtype=np.int64) - np.repeat(task_starts, counts)  # position in its task
        rows += np.repeat(np.array([t.skip for t in members], dtype=np.int64), counts)  # ... in its chunk
        breaks = np.ones(len(ids), dtype=bool)  # a run of consecutive ids inside one task
        breaks[1:] = np.diff(ids) != 1
        breaks[task_starts] = True
        run_starts = np.flatnonzero(breaks)
        run_lengths = np.diff(np.append(run_starts, len(ids)))
        for ref, offset in zip(layout.groups[group], layout.offsets(group)):
            kv = tensors[ref.tensor]
            row_stride, page = kv.stride(0) * kv.element_size(), ref.page_bytes
            slot_ptrs = payloads + offset + rows * page
            kv_ptrs = kv.data_ptr() + ids * row_stride
            if row_stride == page:  # packed rows: one entry per run
                slot_ptrs, kv_ptrs, length = slot_ptrs[run_starts], kv_ptrs[run_starts], run_lengths * page
            else:
                length = np.full(len(ids), page, dtype=np.int64)
            src.append(kv_ptrs if to_slot else slot_ptrs)
            dst.append(slot_ptrs if to_slot else kv_ptrs)
            sizes.append(length)
    if not sizes:
        empty = np.zeros(0, dtype=np.int64)
        return Descriptors(empty, empty.copy(), empty.copy())
    return Descriptors(np.concatenate(src), np.concatenate(dst), np.concatenate(sizes).astype(np.int64))
