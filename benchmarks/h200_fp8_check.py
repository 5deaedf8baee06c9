"""Check and time fp8 on the GPU (``DeviceFp8`` over ``CudaCopier``) outside vLLM, H200 host.

The Llama-3.2-3B shape as vLLM 0.26 lays it out with FLASH_ATTN: 28 per-layer KV tensors of
64 KiB pages (16 tokens x 8 heads x 128 values, K and V), 16 GPU blocks per storage block
(29.4 MB of payload). Random bf16 KV (a few outliers) in ``--chunks`` x 16 GPU blocks:
``store`` every storage block into page-locked slots, then ``load`` them into other GPU blocks.
Each with ``--steps`` (1 block per device step, and the codec's own) and ``--graphs``
(``codec_graphs`` off and on: steps replayed as CUDA graphs), loading into consecutive and then
scattered GPU blocks. Checks (``--check`` blocks spread over all steps): each slot holds exactly
what the CPU codec (``Fp8Codec.encode``) writes for that block's payload, and the loaded GPU
blocks hold exactly the CPU round trip. Prints store and load GB/s of
KV (payload bytes per second) and one JSON line to ``--out``.

    python3 benchmarks/h200_fp8_check.py --out $OUT/fp8_check.jsonl
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np
import torch

from pykv.codec.fp8 import Fp8Codec
from pykv.connector.copier import CopyTask, CudaCopier, TorchCopier, cuda_host_register, cuda_host_unregister
from pykv.connector.device_codec import CodedLoad, DeviceFp8
from pykv.connector.layout import BlockLayout, RefPage
from pykv.staging import StagingPool

LAYERS = 28
LAYER_PAGE = 65_536
BPC = 16


def run(chunks: int, check: int, cuda: bool = True, step_blocks: int | None = None, scatter: bool = False,
        graphs: bool = False) -> dict:
    device = torch.device("cuda" if cuda else "cpu")
    blocks = 2 * chunks * BPC
    generator = torch.Generator(device=device).manual_seed(38)
    tensors = []
    for _ in range(LAYERS):
        values = torch.randn(blocks, LAYER_PAGE // 2, device=device, generator=generator, dtype=torch.float32)
        values[:, ::997] *= 40  # outliers
        tensors.append(values.to(torch.bfloat16).view(torch.int8))
    layout = BlockLayout(BPC, 256, (tuple(RefPage(i, LAYER_PAGE) for i in range(LAYERS)),))
    raw = LAYERS * LAYER_PAGE * BPC
    codec = Fp8Codec("bfloat16")
    copier = CudaCopier(tensors, layout) if cuda else TorchCopier(tensors, layout)
    fp8 = DeviceFp8(codec, copier, [raw], step_blocks=step_blocks, graphs=graphs)
    pool = StagingPool(raw, chunks, register=cuda_host_register if cuda else None,
                       unregister=cuda_host_unregister if cuda else None)
    slots = [torch.frombuffer(pool.view(s), dtype=torch.int8)[:raw] for s in range(chunks)]

    def wait_all(submit, count: int) -> tuple[float, list]:
        ended, cond = [], threading.Condition()

        def done(task, ok, extra):
            with cond:
                ended.append((task, ok, extra))
                cond.notify_all()
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        submit(done)
        with cond:
            assert cond.wait_for(lambda: len(ended) >= count, timeout=120), f"{len(ended)} of {count} ended"
        return time.perf_counter() - began, ended

    source_ids = [np.arange(c * BPC, (c + 1) * BPC) for c in range(chunks)]
    stores = [CopyTask(slots[c], 0, source_ids[c], 0, token=c) for c in range(chunks)]
    store_s, stored = wait_all(lambda done: fp8.store(stores, done), chunks)
    assert all(ok for _, ok, _ in stored), "a store failed"
    lengths = {task.token: n for task, _, n in stored}
    target_ids = [ids + chunks * BPC for ids in source_ids]
    if scatter:  # a second hit's GPU blocks: not one run of consecutive ids
        order = np.random.default_rng(38).permutation(chunks * BPC) + chunks * BPC
        target_ids = [order[c * BPC:(c + 1) * BPC] for c in range(chunks)]
    loads = [CodedLoad(CopyTask(slots[c][:lengths[c]], 0, target_ids[c], 0, token=c), raw, codec.params)
             for c in range(chunks)]
    load_s, loaded = wait_all(lambda done: fp8.load(loads, done), chunks)
    assert all(ok for _, ok, _ in loaded), [failure for _, ok, failure in loaded if not ok][:3]

    cpu = [t.cpu() for t in tensors]
    reference = TorchCopier(cpu, layout)
    mismatched = []
    for c in sorted(set(np.linspace(0, chunks - 1, min(check, chunks)).astype(int).tolist())):  # every step's
        payload = torch.zeros(raw, dtype=torch.int8)
        reference.to_slots([CopyTask(payload, 0, source_ids[c], 0)], lambda t, ok: None)
        expected = codec.encode(payload.numpy().tobytes())
        if slots[c].numpy().tobytes()[:lengths[c]] != expected:
            mismatched.append(f"store {c}")
        back = torch.frombuffer(bytearray(codec.decode_bytes(expected, raw)), dtype=torch.int8)
        loaded_payload = torch.zeros(raw, dtype=torch.int8)
        reference.to_slots([CopyTask(loaded_payload, 0, target_ids[c], 0)], lambda t, ok: None)
        if not torch.equal(loaded_payload, back):
            mismatched.append(f"load {c}")
    fp8.close()
    copier.close()
    slots.clear()
    result = {"chunks": chunks, "step_blocks": fp8.step_blocks, "scatter": scatter, "payload_bytes": raw,
              "graphs": graphs, "graph_steps": fp8.stats["codec_graph_steps"],
              "stored_bytes": lengths[0],
              "store_s": round(store_s, 4), "load_s": round(load_s, 4),
              "store_gbps": round(chunks * raw / store_s / 1e9, 2), "load_gbps": round(chunks * raw / load_s / 1e9, 2),
              "checked": min(check, chunks), "mismatched": mismatched}
    pool.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=48, help="storage blocks (29.4 MB of KV each)")
    parser.add_argument("--check", type=int, default=6, help="blocks compared byte for byte with the CPU codec")
    parser.add_argument("--out", default=None)
    parser.add_argument("--cpu", action="store_true", help="a smoke test of this script on the CPU")
    parser.add_argument("--steps", default="1,0", help="step_blocks to compare side by side (0: the codec's own)")
    parser.add_argument("--graphs", default="0", help="codec_graphs values to compare side by side (0, 1 or 0,1)")
    args = parser.parse_args()
    run(2, 2, not args.cpu)  # warm-up (allocator, kernels)
    for scatter in (False, True):
        for step, graphs in ((int(x), g == "1") for x in args.steps.split(",") for g in args.graphs.split(",")):
            result = run(args.chunks, args.check, not args.cpu, step or None, scatter, graphs)
            print(f"fp8 on {'cpu' if args.cpu else torch.cuda.get_device_name()}: {args.chunks} blocks of "
                  f"{result['payload_bytes']} bytes (stored {result['stored_bytes']}), {result['step_blocks']} per "
                  f"step, {'scattered' if scatter else 'consecutive'} GPU blocks, {result['graph_steps']} steps "
                  f"replayed as graphs: store {result['store_gbps']} GB/s, "
                  f"load {result['load_gbps']} GB/s of KV; {result['checked']} checked against the CPU codec, "
                  f"mismatched: {result['mismatched'] or 'none'}")
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps({"kind": "fp8_check", **result}) + "\n")


if __name__ == "__main__":
    main()
