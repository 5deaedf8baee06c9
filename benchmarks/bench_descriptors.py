"""Host time to build one load batch's copy entries: vectorised ``copy_descriptors`` against a
loop per (storage block, canonical ref), side by side (no GPU needed).

The shape is an 80k-token hit of the Llama-3.2-3B shape as vLLM 0.26 hands it to pykv with
FLASH_ATTN: 320 storage blocks of 16 GPU blocks, 28 per-layer KV tensors of 64 KiB pages;
block ids ascending (runs merge into 1 MiB entries) or descending (one entry per page).

    python benchmarks/bench_descriptors.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pykv.connector.copier import CopyTask, contiguous_runs
from pykv.connector.descriptors import Descriptors, copy_descriptors
from pykv.connector.layout import BlockLayout

LAYERS, BPC, CHUNKS, PAGE = 28, 16, 320, 65_536


def per_block_loop(tasks, tensors, layout: BlockLayout, *, to_slot: bool) -> Descriptors:
    """The first implementation: numpy work per (task, ref) in a Python loop."""
    src, dst, sizes = [], [], []
    for task in tasks:
        ids = np.asarray(task.gpu_ids, dtype=np.int64)
        for ref, offset in zip(layout.groups[task.group], layout.offsets(task.group)):
            kv = tensors[ref.tensor]
            stride = kv.stride(0) * kv.element_size()
            runs = contiguous_runs(ids) if stride == ref.page_bytes else [(i, int(b), 1) for i, b in enumerate(ids)]
            for position, first, count in runs:
                slot = task.payload.data_ptr() + offset + (task.skip + position) * ref.page_bytes
                device = kv.data_ptr() + first * stride
                src.append(device if to_slot else slot)
                dst.append(slot if to_slot else device)
                sizes.append(count * ref.page_bytes)
    return Descriptors(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), np.array(sizes, dtype=np.int64))


def main() -> None:
    from pykv.connector.layout import RefPage
    tensors = [torch.empty((CHUNKS * BPC, PAGE), dtype=torch.int8) for _ in range(LAYERS)]
    layout = BlockLayout(BPC, 256, (tuple(RefPage(i, PAGE) for i in range(LAYERS)),))
    payload = torch.empty(LAYERS * BPC * PAGE, dtype=torch.int8)
    print(f"{CHUNKS} storage blocks x {LAYERS} per-layer tensors, best of 5")
    for order, step in (("ascending ids", 1), ("descending ids", -1)):
        tasks = [CopyTask(payload, 0, np.arange(c * BPC, (c + 1) * BPC, dtype=np.int64)[::step].copy(), 0)
                 for c in range(CHUNKS)]
        timings = {}
        for name, build in (("loop per (block, ref)", per_block_loop), ("vectorised", copy_descriptors)):
            best = float("inf")
            for _ in range(5):
                began = time.perf_counter()
                entries = build(tasks, tensors, layout, to_slot=False)
                best = min(best, time.perf_counter() - began)
            timings[name] = best
            print(f"  {order:15s} {name:22s} {len(entries):7,d} entries {best * 1e3:8.1f} ms")
        print(f"  {order:15s} speed-up {timings['loop per (block, ref)'] / timings['vectorised']:.0f}x")


if __name__ == "__main__":
    main()
