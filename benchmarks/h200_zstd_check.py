"""Check and time ``planes-zstd`` (or ``fp8-zstd``) loads decoded on the GPU outside vLLM, H200 host.

The shape of ``h200_fp8_check.py`` (Llama-3.2-3B as vLLM 0.26 lays it out: 28 KV tensors of
64 KiB pages, 16 GPU blocks per storage block, 29.4 MB of payload). bf16 KV like a dummy-weight
engine's (small values, few binades) in ``--chunks`` storage blocks, encoded by the CPU codec
into page-locked slots, then loaded into other GPU blocks (consecutive, then scattered) with each
frame decoder mode (``NvcompFrames.modes``, forced here; the engine keeps the first that passes
its start check, which is printed too). Checks: the loaded blocks equal their source blocks byte
for byte (``--codec fp8-zstd``: ``DeviceFp8Zstd``; the loaded blocks equal the CPU codec's round
trip of their source blocks byte for byte). Prints load GB/s of KV and the device codec's counters per mode, one JSON line per
run to ``--out``. Needs nvCOMP importable (``h200_run.sh setup`` installs it into its deps).

    python3 benchmarks/h200_zstd_check.py --out $OUT/zstd_check.jsonl
    python3 benchmarks/h200_zstd_check.py --chunk-kib 64 --authenticated --modes batched,sized   # as under a MAC
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np
import torch

from pykv.codec.fp8_zstd import Fp8ZstdCodec
from pykv.codec.lossless import PlanesZstdCodec
from pykv.connector.copier import CopyTask, CudaCopier, TorchCopier, cuda_host_register, cuda_host_unregister
from pykv.connector.device_codec import CodedLoad
from pykv.connector.device_fp8_zstd import DeviceFp8Zstd
from pykv.connector.device_zstd import DevicePlanesZstd
from pykv.connector.zstd_frames import HostFrames
from pykv.connector.layout import BlockLayout, RefPage
from pykv.staging import StagingPool

LAYERS = 28
LAYER_PAGE = 65_536
BPC = 16


def kv_tensors(blocks: int, device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(38)
    return [(torch.randn(blocks, LAYER_PAGE // 2, device=device, generator=generator) * 0.02)
            .to(torch.bfloat16).view(torch.int8) for _ in range(LAYERS)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_loads(device_codec: DevicePlanesZstd, loads: list[CodedLoad]) -> tuple[float, list]:
    ended, cond = [], threading.Condition()

    def done(task, ok, failure):
        with cond:
            ended.append((task, ok, failure))
            cond.notify_all()

    sync()
    began = time.perf_counter()
    device_codec.load(loads, done)
    with cond:
        assert cond.wait_for(lambda: len(ended) >= len(loads), timeout=300), f"{len(ended)} of {len(loads)} ended"
    return time.perf_counter() - began, ended


def wrong_payloads(tensors, layout, target_ids, expected: list[bytes], raw: int) -> int:
    """How many loaded blocks differ from the CPU codec's round trip of their source."""
    host = TorchCopier([t.cpu() for t in tensors], layout)
    wrong = 0
    for ids, want in zip(target_ids, expected):
        got = torch.zeros(raw, dtype=torch.int8)
        host.to_slots([CopyTask(got, 0, ids, 0)], lambda t, ok: None)
        wrong += got.numpy().tobytes() != want
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=32, help="storage blocks (29.4 MB of KV each)")
    parser.add_argument("--threads", type=int, default=8, help="CPU encoder threads")
    parser.add_argument("--step-blocks", default="0", help="comma list of step_blocks (0: the codec's own)")
    parser.add_argument("--codec", default="planes-zstd", choices=("planes-zstd", "fp8-zstd"))
    parser.add_argument("--chunk-kib", type=int, default=0, help="the codec's chunk in KiB (0: its own)")
    parser.add_argument("--authenticated", action="store_true",
                        help="the start check as under auth_key_file (nvCOMP's fast modes kept)")
    parser.add_argument("--modes", default="", help="comma list of frame decoder modes timed (default: all)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--cpu", action="store_true", help="a smoke test of this script (zstandard on the host)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    chunks = args.chunks
    tensors = kv_tensors(2 * chunks * BPC, device)
    layout = BlockLayout(BPC, 256, (tuple(RefPage(i, LAYER_PAGE) for i in range(LAYERS)),))
    raw = LAYERS * LAYER_PAGE * BPC
    lossy = args.codec == "fp8-zstd"
    sized = {"chunk": args.chunk_kib << 10} if args.chunk_kib else {}
    codec = Fp8ZstdCodec(threads=args.threads, **sized) if lossy else PlanesZstdCodec(threads=args.threads, **sized)
    pool = StagingPool(-(-codec.encoded_bound(raw) // 4096) * 4096, chunks, register=None if args.cpu else cuda_host_register,
                       unregister=None if args.cpu else cuda_host_unregister)
    slots = [torch.frombuffer(pool.view(s), dtype=torch.int8) for s in range(chunks)]
    reference = TorchCopier([t.cpu() for t in tensors], layout)
    source_ids = [np.arange(c * BPC, (c + 1) * BPC) for c in range(chunks)]
    lengths = []
    encode_s = 0.0
    for c in range(chunks):
        payload = torch.zeros(raw, dtype=torch.int8)
        reference.to_slots([CopyTask(payload, 0, source_ids[c], 0)], lambda t, ok: None)
        began = time.perf_counter()
        lengths.append(codec.encode(payload.numpy(), slots[c].numpy()))
        encode_s += time.perf_counter() - began
    expected = [codec.decode_bytes(slots[c].numpy()[:lengths[c]], raw) for c in range(chunks)] if lossy else None
    codec.close()
    base = {"kind": "zstd_check", "codec": args.codec, "codec_params": codec.params, "authenticated": args.authenticated,
            "chunks": chunks, "payload_bytes": raw, "ratio": round(sum(lengths) / (chunks * raw), 4),
            "encode_gbps_cpu": round(chunks * raw / encode_s / 1e9, 2), "encode_threads": args.threads}
    print(json.dumps(base))
    copier = TorchCopier(tensors, layout) if args.cpu else CudaCopier(tensors, layout)
    for step in (int(x) for x in args.step_blocks.split(",")):
        layer = codec.frames if lossy else codec
        frames = HostFrames(layer) if args.cpu else None
        guards = {"authenticated": args.authenticated}
        zstd = (DeviceFp8Zstd(codec, copier, [raw], frames, step_blocks=step or None, **guards) if lossy else
                DevicePlanesZstd(codec, copier, raw, frames, step_blocks=step or None, **guards))
        try:
            zstd.self_test()
            chosen = getattr(zstd.frames, "mode", "host")
        except Exception as exc:  # noqa: BLE001 - reported; the modes are still timed
            chosen = f"none ({type(exc).__name__}: {exc})"[:300]
        print(f"start check: {chosen}")
        for mode in [m for m in getattr(zstd.frames, "modes", ("host",)) if not args.modes or m in args.modes.split(",")]:
            zstd.frames.mode = mode
            for scatter in (False, True):
                target_ids = [ids + chunks * BPC for ids in source_ids]
                if scatter:
                    order = np.random.default_rng(38).permutation(chunks * BPC) + chunks * BPC
                    target_ids = [order[c * BPC:(c + 1) * BPC] for c in range(chunks)]
                for t in tensors:
                    t[chunks * BPC:].zero_()
                loads = [CodedLoad(CopyTask(slots[c][:lengths[c]], 0, target_ids[c], 0, token=c), raw, codec.params)
                         for c in range(chunks)]
                record = {**base, "mode": mode, "chosen": chosen, "step_blocks": zstd.step_blocks, "scatter": scatter}
                try:
                    timed_loads(zstd, loads[:2])  # warm-up: kernels, configs
                    before = dict(zstd.stats)
                    seconds, ended = timed_loads(zstd, loads)
                    sync()
                    failed = [str(f) for _, ok, f in ended if not ok]
                    wrong = (wrong_payloads(tensors, layout, target_ids, expected, raw) if lossy else
                             sum(not torch.equal(t[target_ids[c]], t[source_ids[c]]) for c in range(chunks) for t in tensors))
                    record.update(load_s=round(seconds, 4), load_gbps=round(chunks * raw / seconds / 1e9, 2),
                                  failed=failed[:3], wrong_pages=int(wrong),
                                  stats={k: v - before.get(k, 0) for k, v in zstd.stats.items()})
                except Exception as exc:  # noqa: BLE001 - a mode that fails: reported, the next one runs
                    record["error"] = f"{type(exc).__name__}: {exc}"[:600]
                print(json.dumps(record))
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(record) + "\n")
        zstd.close()
    copier.close()
    slots.clear()
    pool.close()


if __name__ == "__main__":
    main()
