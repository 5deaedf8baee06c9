"""Check and time pykv's CUDA copier outside vLLM (H200 host; needs vLLM for the batched op).

For the Llama-3.2-3B shape (16 blocks of 16 tokens per 256-token storage block;
one cross-layer page of 16 x 114,688 bytes per GPU block, or 28 per-layer pages
of 64 KiB as vLLM 0.26 lays them out with FLASH_ATTN) it loads ``--chunks``
storage blocks from page-locked staging slots into a KV tensor with
``CudaCopier`` twice - vLLM's batched copy op, then torch copies (gather and
``index_copy_``) - in the same run, checks every byte against the slot, and
prints GB/s of each, next to one plain pinned H2D copy of the same bytes.
A packed cross-layer tensor, one with padded rows and 28 per-layer tensors are
tried. One JSON line per
measurement goes to ``--out``.

    python3 benchmarks/h200_copy_check.py --out $OUT/copy_check.jsonl
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np
import torch

from pykv.connector import compat
from pykv.connector.copier import CopyTask, CudaCopier, TorchCopier, cuda_host_register, cuda_host_unregister
from pykv.connector.layout import BlockLayout, RefPage
from pykv.staging import StagingPool

PAGE = 16 * 114_688  # one GPU block of the 3B shape, all layers (a cross-layer page)
LAYER_PAGE = 65_536  # one GPU block of one layer (K and V): vLLM 0.26 with FLASH_ATTN keeps 28 such tensors
BPC = 16


def move_all(copier: CudaCopier, tasks: list[CopyTask], batch: int, *, store: bool = False) -> float:
    """Seconds to move every task (``batch`` tasks per ``from_slots`` call, as the reactor hands them;
    ``store``: ``to_slots``, device to slots)."""
    done = threading.Semaphore(0)
    failed: list[CopyTask] = []

    def finished(task: CopyTask, ok: bool) -> None:
        if not ok:
            failed.append(task)
        done.release()

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    began = time.perf_counter()
    move = copier.to_slots if store else copier.from_slots
    for i in range(0, len(tasks), batch):
        move(tasks[i:i + batch], finished)
    for _ in tasks:
        done.acquire()
    seconds = time.perf_counter() - began
    if failed:
        raise SystemExit(f"{len(failed)} copies failed")
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=64, help="storage blocks in staging (28 MiB each)")
    p.add_argument("--rounds", type=int, default=5, help="passes over the slots per measurement (bytes moved)")
    p.add_argument("--batch", type=int, default=16, help="storage blocks per from_slots call")
    p.add_argument("--out", default="copy_check.jsonl")
    a = p.parse_args()
    cuda = torch.cuda.is_available()  # without CUDA: TorchCopier on CPU tensors (checks this script's logic)
    device = torch.device("cuda" if cuda else "cpu")
    slot_bytes = PAGE * BPC
    pool = StagingPool(slot_bytes, a.chunks, register=cuda_host_register if cuda else None,
                       unregister=cuda_host_unregister if cuda else None)
    slots = [torch.frombuffer(pool.view(s), dtype=torch.int8) for s in range(a.chunks)]
    generator = torch.Generator().manual_seed(0)
    for s in slots:
        s.copy_(torch.randint(-128, 127, (slot_bytes,), dtype=torch.int8, generator=generator))
    blocks = a.chunks * BPC * a.rounds
    cross = BlockLayout(BPC, 256, ((RefPage(0, PAGE),),))
    layers = PAGE // LAYER_PAGE
    per_layer = BlockLayout(BPC, 256, (tuple(RefPage(i, LAYER_PAGE) for i in range(layers)),))
    shapes = {  # name: (layout, KV tensors)
        "packed": (cross, [torch.zeros((blocks + 64, PAGE), dtype=torch.int8, device=device)]),
        "padded rows": (cross, [torch.zeros((blocks + 64, PAGE + 4096), dtype=torch.int8, device=device)]),
        "per layer": (per_layer, [torch.zeros((blocks + 64, LAYER_PAGE), dtype=torch.int8, device=device)
                                  for _ in range(layers)]),
    }
    shapes["per layer, ids descending"] = shapes["per layer"]  # no runs to merge: one 64 KiB copy per page
    rng = np.random.default_rng(0)
    order = rng.permutation(blocks // BPC)  # chunks land at scattered places, each a run of 16 blocks
    out = open(a.out, "a")
    if cuda:
        h = torch.frombuffer(pool.view(0), dtype=torch.int8)
        d = torch.empty_like(h, device=device)
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(a.chunks * a.rounds):
            d.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        h2d = slot_bytes * a.chunks * a.rounds / (time.perf_counter() - began) / 1e9
        print(f"plain pinned H2D, {slot_bytes >> 20} MiB copies: {h2d:.1f} GB/s")
        out.write(json.dumps({"what": "h2d_28MiB", "gb_per_s": round(h2d, 2)}) + "\n")
    for shape, (layout, tensors) in shapes.items():
        for batched in (True, False) if cuda else (False,):
            copier = CudaCopier(tensors, layout, batched=batched) if cuda else TorchCopier(tensors, layout)
            kind = "batched op" if getattr(copier, "_batch_op", None) is not None else "torch copies"
            if batched and kind != "batched op":
                print("vLLM's swap_blocks_batch is not available here")
            step = -1 if "descending" in shape else 1
            tasks = [CopyTask(slots[i % a.chunks], 0, np.arange(c * BPC, (c + 1) * BPC, dtype=np.int64)[::step], 0)
                     for i, c in enumerate(order)]
            for kv in tensors:
                kv.zero_()
            move_all(copier, tasks[:a.batch], a.batch)  # warm-up
            for kv in tensors:
                kv.zero_()
            seconds = move_all(copier, tasks, a.batch)
            moved = len(tasks) * slot_bytes
            bad = 0
            for i, c in enumerate(order):  # every byte where it belongs (payload: each ref's pages in turn)
                rows = [kv[c * BPC:(c + 1) * BPC, :ref.page_bytes] for kv, ref in zip(tensors, layout.groups[0])]
                pages = [(r.flip(0) if step < 0 else r).reshape(-1) for r in rows]
                bad += int(not torch.equal(torch.cat(pages).cpu(), slots[i % a.chunks]))
            stored, store_bad, store_rate = store_back(copier, tasks[:a.chunks], slots, a.batch)
            copier.close()
            rate = moved / seconds / 1e9
            print(f"{shape:12s} {kind:13s} {rate:6.1f} GB/s  ({moved / 1e9:.1f} GB, {len(tasks)} storage blocks, "
                  f"{bad} wrong)")
            out.write(json.dumps({"what": "copier_load", "shape": shape, "copy": kind, "gb_per_s": round(rate, 2),
                                  "bytes": moved, "blocks": len(tasks), "wrong_blocks": bad,
                                  "vllm": compat.VLLM_VERSION}) + "\n")
            print(f"{'':12s} {'stores':13s} {store_rate:6.1f} GB/s  ({stored} storage blocks back to their slots, "
                  f"{store_bad} wrong)")
            out.write(json.dumps({"what": "copier_store", "shape": shape, "copy": kind,
                                  "gb_per_s": round(store_rate, 2), "blocks": stored, "wrong_blocks": store_bad,
                                  "vllm": compat.VLLM_VERSION}) + "\n")
            if bad or store_bad:
                return 1
    pool.close()
    return 0


def store_back(copier, tasks: list[CopyTask], slots: list[torch.Tensor], batch: int) -> tuple[int, int, float]:
    """Copy the chunks the loads filled back into their (zeroed) slots: (blocks, wrong ones, GB/s).
    ``tasks[i]`` loaded slot ``i``, so slot ``i`` must come back as it was."""
    expected = [slots[i].clone() for i in range(len(tasks))]
    for i in range(len(tasks)):
        slots[i].zero_()
    seconds = move_all(copier, tasks, batch, store=True)
    wrong = sum(int(not torch.equal(slots[i], expected[i])) for i in range(len(tasks)))
    for i in range(len(tasks)):
        slots[i].copy_(expected[i])
    return len(tasks), wrong, len(tasks) * slots[0].numel() / seconds / 1e9


if __name__ == "__main__":
    raise SystemExit(main())
