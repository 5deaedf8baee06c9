"""Decoded payloads on the KV's device into their KV cache blocks, with indexing kernels.

A device codec's load step leaves the decoded payloads of several storage blocks in rows of one
device buffer (row ``i``: the payload of ``tasks[i]``; payload layout: ``layout.BlockLayout``).
``scatter_rows`` writes every page of them into its GPU block with one ``index_put_`` per KV
tensor (ref) for the whole step, whatever order vLLM handed the blocks out in (``RowScatter``
keeps the views it needs, so a step makes few torch calls). Copy-engine
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


class RowScatter:
    """``scatter_rows`` for one set of KV tensors and one payload scratch, its views made once.

    Every torch call gives the GIL up; beside vLLM's engine loop each can wait to take it back
    (``pykv.gil``), so a step's calls are what it costs: here one copy of the ids and one
    ``index_put_`` per KV tensor (plus one gather each for partial chunks), the views of the KV
    tensors and of the scratch's rows being kept by (rows, row length, group)."""

    _KEPT = 256  # view sets kept at most (rows x lengths x groups; an engine has a few)

    def __init__(self, tensors: Sequence[torch.Tensor], layout: BlockLayout, payload: torch.Tensor) -> None:
        self.tensors, self.layout, self.payload = tensors, layout, payload
        self._views: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._blocks = [min(tensors[ref.tensor].shape[0] for ref in refs) for refs in layout.groups]

    def _pairs(self, count: int, raw: int, group: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(KV tensor, its pages in rows ``0..count``) of each ref of ``group``, as words or bytes."""
        key = (count, raw, group)
        pairs = self._views.get(key)
        if pairs is None:
            if len(self._views) >= self._KEPT:
                self._views.clear()
            bpc = self.layout.blocks_per_chunk
            rows = self.payload[:count * raw].view(count, raw)
            pairs = []
            for ref, offset in zip(self.layout.groups[group], self.layout.offsets(group)):
                page = ref.page_bytes
                kv = self.tensors[ref.tensor]
                if kv.shape[1] != page:
                    kv = kv.narrow(1, 0, page)
                pages = rows[:, offset:offset + page * bpc].unflatten(1, (bpc, page))
                pairs.append(_words(kv.view(torch.uint8), pages.view(torch.uint8)))
            self._views[key] = pairs
        return pairs

    def whole_ids(self, tasks: Sequence) -> tuple[int, np.ndarray] | None:
        """(group, the ids of row 0's pages, then row 1's, ...) where every task is a whole chunk
        of one group (one index for the whole step: ``put_whole``), else None. ``IndexError`` as
        ``rows``'."""
        bpc = self.layout.blocks_per_chunk
        if not tasks or any(len(t.gpu_ids) != bpc or t.skip != 0 or t.group != tasks[0].group for t in tasks):
            return None
        group = tasks[0].group
        ids = np.concatenate([np.asarray(t.gpu_ids, dtype=np.int64) for t in tasks])
        self._check(group, ids)
        return group, ids

    def put_whole(self, count: int, raw: int, group: int, index: torch.Tensor) -> None:
        """Rows ``0..count`` of the payload into the KV blocks of ``index`` (``count`` x blocks per
        chunk device ids, checked by ``whole_ids``), queued on the current stream."""
        for target, source in self._pairs(count, raw, group):
            target.index_put_((index,), source)

    def _check(self, group: int, ids: np.ndarray) -> None:
        """Checked before any device work: a device assert kills the context."""
        if not 0 <= ids.min() <= ids.max() < self._blocks[group]:
            raise IndexError(f"GPU block ids {ids.min()}..{ids.max()} outside 0..{self._blocks[group] - 1}")

    def rows(self, raw: int, tasks: Sequence) -> list[torch.Tensor]:
        """Row ``i`` of the payload (rows of ``raw`` bytes) into the KV blocks of ``tasks[i]``
        (``CopyTask``: its ``group``, ``gpu_ids`` and ``skip``; its own ``payload`` is not read),
        queued on the current stream. Returns the index tensors, which must live until the
        stream passes the work. ``IndexError`` (before any device work) for ids outside the KV
        tensors or a chunk overrun. Ids are vLLM's, one load per GPU block in a step."""
        bpc = self.layout.blocks_per_chunk
        keep: list[torch.Tensor] = []
        whole = self.whole_ids(tasks)
        if whole is not None:  # every row, every page: the rows are the values as they lie
            group, ids = whole
            self.put_whole(len(tasks), raw, group, _to_device(ids, self.payload.device, keep).view(len(tasks), bpc))
            return keep
        by_group: dict[int, list[int]] = {}
        for i, task in enumerate(tasks):
            if len(task.gpu_ids):
                if task.skip < 0 or len(task.gpu_ids) + task.skip > bpc:
                    raise IndexError(f"{len(task.gpu_ids)} blocks after {task.skip} skipped in a chunk of {bpc}")
                by_group.setdefault(task.group, []).append(i)
        ids_of = {group: np.concatenate([np.asarray(tasks[i].gpu_ids, dtype=np.int64) for i in members])
                  for group, members in by_group.items()}
        for group, ids in ids_of.items():
            self._check(group, ids)
        for group, members in by_group.items():
            pairs = self._pairs(len(tasks), raw, group)
            # (row, page in its chunk) of each id, with the ids: one copy to the device
            row_of = np.repeat(np.asarray(members, dtype=np.int64), [len(tasks[i].gpu_ids) for i in members])
            page_of = np.concatenate([np.arange(tasks[i].skip, tasks[i].skip + len(tasks[i].gpu_ids))
                                      for i in members])
            device_ids, rows, pages = _to_device(np.stack([ids_of[group], row_of, page_of]), self.payload.device,
                                                 keep).unbind(0)
            for target, source in pairs:
                target.index_put_((device_ids,), source[rows, pages])
        return keep


def scatter_rows(tensors: Sequence[torch.Tensor], layout: BlockLayout, payload: torch.Tensor, raw: int,
                 tasks: Sequence) -> list[torch.Tensor]:
    """``RowScatter.rows`` once: row ``i`` of ``payload`` (1-d int8/uint8 on the KV's device, rows
    of ``raw`` bytes) into the KV blocks of ``tasks[i]``."""
    return RowScatter(tensors, layout, payload).rows(raw, tasks)
