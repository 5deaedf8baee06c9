"""Decoded payloads on the KV's device into their KV cache blocks, with indexing kernels.

A device codec's load step leaves the decoded payloads of several storage blocks in rows of one
device buffer (row ``i``: the payload of ``tasks[i]``; payload layout: ``layout.BlockLayout``).
``scatter_rows`` writes every page of them into its GPU block with one ``index_put_`` per KV
tensor (ref) for the whole step, whatever order vLLM handed the blocks out in. Copy-engine
copies of one page each (``copy_descriptors`` where ids are not ascending runs: a second hit's
blocks come back in descending order) ran at a quarter of the speed on the H200.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from pykv.connector.layout import BlockLayout

_WIDE = torch.int64


def _words(kv: torch.Tensor, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both byte views as 8-byte words where their shapes and offsets allow, else as bytes (never
    in the KV's own dtype: an fp8 cache's kernels are not needed to move bits)."""
    try:
        return kv.view(_WIDE), pages.view(_WIDE)
    except RuntimeError:  # a size, stride or offset not a multiple of 8 bytes
        return kv.view(torch.uint8), pages.view(torch.uint8)


def _to_device(array: np.ndarray, device: torch.device, keep: list[torch.Tensor]) -> torch.Tensor:
    """``array`` on ``device``, queued on the current stream (from page-locked memory on CUDA, so
    the copy never waits for the stream); both tensors go into ``keep``."""
    host = torch.from_numpy(array)
    if device.type == "cuda":
        host = host.pin_memory()
    moved = host.to(device, non_blocking=True)
    keep += [host, moved]
    return moved


def scatter_rows(tensors: Sequence[torch.Tensor], layout: BlockLayout, payload: torch.Tensor, raw: int,
                 tasks: Sequence) -> list[torch.Tensor]:
    """Row ``i`` of ``payload`` (1-d int8/uint8 on the KV's device, rows of ``raw`` bytes) into the
    KV blocks of ``tasks[i]`` (``CopyTask``: its ``group``, ``gpu_ids`` and ``skip``; its own
    ``payload`` is not read), queued on the current stream. Returns the index tensors, which must
    live until the stream passes the work. ``IndexError`` (before any device work) for ids outside
    the KV tensors or a chunk overrun. Ids are vLLM's, one load per GPU block in a step."""
    bpc = layout.blocks_per_chunk
    rows = payload[:len(tasks) * raw].view(len(tasks), raw)
    keep: list[torch.Tensor] = []
    by_group: dict[int, list[int]] = {}
    for i, task in enumerate(tasks):
        if len(task.gpu_ids):
            if task.skip < 0 or len(task.gpu_ids) + task.skip > bpc:
                raise IndexError(f"{len(task.gpu_ids)} blocks after {task.skip} skipped in a chunk of {bpc}")
            by_group.setdefault(task.group, []).append(i)
    ids_of = {group: np.concatenate([np.asarray(tasks[i].gpu_ids, dtype=np.int64) for i in members])
              for group, members in by_group.items()}
    for group, ids in ids_of.items():  # checked before any device work: a device assert kills the context
        blocks = min(tensors[ref.tensor].shape[0] for ref in layout.groups[group])
        if not 0 <= ids.min() <= ids.max() < blocks:
            raise IndexError(f"GPU block ids {ids.min()}..{ids.max()} outside 0..{blocks - 1}")
    for group, members in by_group.items():
        whole = len(members) == len(tasks) and all(len(tasks[i].gpu_ids) == bpc and tasks[i].skip == 0
                                                   for i in members)
        ids = ids_of[group]
        device_ids = _to_device(ids, payload.device, keep)
        if whole:  # every row, every page: the rows are the values as they lie
            index = (device_ids.view(len(members), bpc),)
        else:  # (row, page in its chunk) of each id
            row_of = np.repeat(np.asarray(members, dtype=np.int64), [len(tasks[i].gpu_ids) for i in members])
            page_of = np.concatenate([np.arange(tasks[i].skip, tasks[i].skip + len(tasks[i].gpu_ids))
                                      for i in members])
            picks = _to_device(np.stack([row_of, page_of]), payload.device, keep)
        for ref, offset in zip(layout.groups[group], layout.offsets(group)):
            page = ref.page_bytes
            kv = tensors[ref.tensor]
            if kv.shape[1] != page:
                kv = kv.narrow(1, 0, page)
            pages = rows[:, offset:offset + page * bpc].unflatten(1, (bpc, page))
            target, source = _words(kv.view(torch.uint8), pages.view(torch.uint8))
            if whole:
                target.index_put_(index, source)
            else:
                target.index_put_((device_ids,), source[picks[0], picks[1]])
    return keep
