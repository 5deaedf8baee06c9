"""Probe: can nvCOMP decode ``planes-zstd``'s frames on the GPU, and how fast? (H200 host, issue 38)

Installs the carried nvCOMP wheels (``--wheels``: ``.device/nvcomp`` or ``/tmp/pykv-device/nvcomp``) into a private
folder, encodes dummy-weight-like bf16 KV blocks (29.4 MB each, the 3B shape) with
``planes-zstd`` on the CPU, copies the stored bytes to the GPU and decodes every zstd frame of
a batch of blocks in one nvCOMP call (``BitstreamKind.RAW``: standard frames), then merges the
planes on the GPU (``lo | hi << 8``) and compares the payload with the original. Prints what
worked, the ratio, and GB/s of KV for: H2D of the stored bytes, the batched decode, the merge.
A probe for the next step, not the engine: every API variant that fails is printed and skipped.

    python3 benchmarks/h200_nvcomp_probe.py --out $OUT/nvcomp_probe.jsonl
"""

from __future__ import annotations

import argparse
import glob
import json
import struct
import subprocess
import sys
import time
import traceback

import numpy as np
import torch

from pykv.codec.lossless import PlanesZstdCodec

BLOCK = 28 * 65_536 * 16


def install(wheels: str, target: str) -> None:
    files = sorted(glob.glob(f"{wheels}/*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "-t", target, *files],
                   check=True)
    sys.path.insert(0, target)


def kv_like(blocks: int) -> np.ndarray:
    """bf16 values like a dummy-weight engine's KV: small, few binades."""
    generator = torch.Generator().manual_seed(38)
    values = torch.randn(blocks * BLOCK // 2, generator=generator) * 0.02
    return values.to(torch.bfloat16).view(torch.uint8).numpy()


def frames_of(stored: bytes, codec: PlanesZstdCodec, payload_len: int) -> list[tuple[int, int, int, int]]:
    """(chunk, plane, offset, length) of every zstd frame of one stored block (raw planes skipped)."""
    chunks = [(start, min(codec.chunk, payload_len - start)) for start in range(0, payload_len, codec.chunk)]
    table = struct.unpack_from(f"<{2 * len(chunks)}I", stored, 0)
    offset, out = 8 * len(chunks), []
    for c, (_, length) in enumerate(chunks):
        for plane in range(2):
            n = table[2 * c + plane]
            if n < length // 2:
                out.append((c, plane, offset, n))
            offset += n
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", default=None, help="nvCOMP wheels (default .device/nvcomp, else /tmp/pykv-device/nvcomp)")
    parser.add_argument("--site", default="/tmp/nvcomp-site")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    record: dict = {"kind": "nvcomp_probe", "blocks": args.blocks, "block_bytes": BLOCK}
    wheels = args.wheels or next((d for d in (".device/nvcomp", "/tmp/pykv-device/nvcomp") if glob.glob(f"{d}/*.whl")),
                                 ".device/nvcomp")
    install(wheels, args.site)
    from nvidia import nvcomp
    record["nvcomp"] = getattr(nvcomp, "__version__", "?")
    payload = kv_like(args.blocks)
    codec = PlanesZstdCodec(threads=8)
    stored = [codec.encode(payload[b * BLOCK:(b + 1) * BLOCK]) for b in range(args.blocks)]
    record["ratio"] = round(sum(map(len, stored)) / payload.nbytes, 4)
    frames = [frames_of(s, codec, BLOCK) for s in stored]
    record["frames_per_block"] = len(frames[0])
    device = torch.device("cuda")
    stream = torch.cuda.current_stream()
    pinned = [torch.frombuffer(bytearray(s), dtype=torch.uint8).pin_memory() for s in stored]
    torch.cuda.synchronize()
    began = time.perf_counter()
    on_gpu = [p.to(device, non_blocking=True) for p in pinned]
    torch.cuda.synchronize()
    record["h2d_gbps_of_kv"] = round(payload.nbytes / (time.perf_counter() - began) / 1e9, 1)
    inputs = [on_gpu[b][off:off + n] for b, block in enumerate(frames) for (_, _, off, n) in block]
    for variant in ("as_arrays", "as_array_list"):
        try:
            nv = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW,
                              cuda_stream=stream.cuda_stream)
            arrays = nvcomp.as_arrays(inputs, cuda_stream=stream.cuda_stream) if variant == "as_arrays" else \
                [nvcomp.as_array(t, cuda_stream=stream.cuda_stream) for t in inputs]
            for attempt in range(3):
                torch.cuda.synchronize()
                began = time.perf_counter()
                outputs = nv.decode(arrays)
                decoded = [torch.as_tensor(o, device=device) if hasattr(o, "__cuda_array_interface__")
                           else torch.from_dlpack(o) for o in outputs]
                torch.cuda.synchronize()
                seconds = time.perf_counter() - began
            record[f"decode_{variant}_gbps_of_kv"] = round(payload.nbytes / seconds / 1e9, 1)
            # merge and compare: a plane decoded or raw, per chunk
            index = {(b, c, p): decoded[i] for i, (b, c, p) in enumerate(
                (b, c, p) for b, block in enumerate(frames) for (c, p, _, _) in block)}
            wrong = 0
            torch.cuda.synchronize()
            began = time.perf_counter()
            results = []
            for b in range(args.blocks):
                out = torch.empty(BLOCK // 2, dtype=torch.int16, device=device)
                offset = 8 * ((BLOCK + codec.chunk - 1) // codec.chunk)
                table = struct.unpack_from(f"<{2 * ((BLOCK + codec.chunk - 1) // codec.chunk)}I", stored[b], 0)
                for c in range(len(table) // 2):
                    half = min(codec.chunk, BLOCK - c * codec.chunk) // 2
                    planes = []
                    for p in range(2):
                        n = table[2 * c + p]
                        plane = index.get((b, c, p))
                        planes.append(plane.view(torch.uint8).reshape(-1) if plane is not None
                                      else on_gpu[b][offset:offset + n])
                        offset += n
                    lo, hi = (x.to(torch.int16) for x in planes)
                    out[c * codec.chunk // 2:c * codec.chunk // 2 + half] = lo | (hi << 8)
                results.append(out)
            torch.cuda.synchronize()
            record[f"merge_{variant}_gbps_of_kv"] = round(payload.nbytes / (time.perf_counter() - began) / 1e9, 1)
            for b, out in enumerate(results):
                if out.view(torch.uint8).cpu().numpy().tobytes() != payload[b * BLOCK:(b + 1) * BLOCK].tobytes():
                    wrong += 1
            record[f"wrong_blocks_{variant}"] = wrong
        except Exception as exc:  # noqa: BLE001 - a probe: report and go on
            record[f"error_{variant}"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    print(json.dumps(record))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
