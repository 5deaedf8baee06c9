"""Probe: can nvCOMP decode ``planes-zstd``'s frames on the GPU, and how fast? (H200 host, issue 38)

Installs the carried nvCOMP wheels (``--wheels``: ``.device/nvcomp`` or ``/tmp/pykv-device/nvcomp``) into a private
folder, encodes dummy-weight-like bf16 KV blocks (29.4 MB each, the 3B shape) with
``planes-zstd`` on the CPU, copies the stored bytes to the GPU and decodes every zstd frame of
a batch of blocks in one nvCOMP call (``BitstreamKind.RAW``: standard frames), then merges the
planes on the GPU (``lo | hi << 8``) and compares the payload with the original. Prints what
worked, the ratio, and GB/s of KV for: H2D of the stored bytes, the batched decode, the merge.
Then the same batch into preallocated outputs (``out=``), with and without a prepared
``DecompressConfig``, and hostile frames that decode to fewer or more bytes than their header
declares.
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
from pykv.connector.zstd_frames import lying_frame

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


def _guarded(record: dict, key: str, fn) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a probe: report and go on
        record[f"error_{key}"] = f"{type(exc).__name__}: {exc}"[:600]
        traceback.print_exc()


def probe_into_outputs(nvcomp, stream, inputs: list, reference: list, kv_bytes: int, record: dict) -> None:
    """The same batch decoded into preallocated slices of one device buffer (``out=``: no
    allocation per frame, no copy after), then also with a ``DecompressConfig`` built once
    (``decompression_config``: decode itself no longer synchronizes): GB/s of KV, bit-exact
    against the plain decode, and what the returned entries report."""
    sizes = [r.numel() for r in reference]
    buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=reference[0].device)
    outs = list(torch.split(buffer, sizes))
    nv = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, cuda_stream=stream.cuda_stream)
    arrays = nvcomp.as_arrays(inputs, cuda_stream=stream.cuda_stream)
    targets = nvcomp.as_arrays(outs, cuda_stream=stream.cuda_stream)

    def timed(key: str, **kwargs) -> None:
        for _ in range(3):
            buffer.fill_(0xAB)
            torch.cuda.synchronize()
            began = time.perf_counter()
            returned = nv.decode(arrays, out=targets, **kwargs)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - began
        record[f"decode_{key}_gbps_of_kv"] = round(kv_bytes / seconds / 1e9, 1)
        record[f"wrong_frames_{key}"] = sum(not torch.equal(o, r) for o, r in zip(outs, reference))
        first = returned[0] if hasattr(returned, "__getitem__") else returned
        record[f"returned_{key}"] = f"{type(returned).__name__}, first {type(first).__name__} " \
                                    f"shape {getattr(first, 'shape', '?')} of {sizes[0]}"

    _guarded(record, "out", lambda: timed("out"))

    def configured() -> None:
        began = time.perf_counter()
        config = nv.decompression_config(arrays)
        record["decompression_config_ms"] = round((time.perf_counter() - began) * 1e3, 2)
        timed("out_config", decompression_config=config)

    _guarded(record, "out_config", configured)

    def sized() -> None:  # the engine's "sized" mode: a config from the known sizes, no header read back
        began = time.perf_counter()
        config = nv.decompression_config(nv.compression_config(sizes))
        record["sized_config_ms"] = round((time.perf_counter() - began) * 1e3, 2)
        timed("out_sized", decompression_config=config)

    _guarded(record, "out_sized", sized)


def good_after(nv, nvcomp, stream, device, record: dict, how: str) -> None:
    plane = torch.arange(1 << 16, dtype=torch.int64).remainder(251).to(torch.uint8)
    import zstandard
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(plane.numpy().tobytes())
    source = torch.frombuffer(bytearray(frame), dtype=torch.uint8).to(device)
    out = torch.zeros(plane.numel(), dtype=torch.uint8, device=device)
    nv.decode(nvcomp.as_arrays([source], cuda_stream=stream.cuda_stream),
              out=nvcomp.as_arrays([out], cuda_stream=stream.cuda_stream),
              decompression_config=nv.decompression_config(nv.compression_config([plane.numel()])))
    torch.cuda.synchronize()
    record[f"{how}_then_good"] = f"no error; bit-exact {torch.equal(out.cpu(), plane)}"


def probe_lying_frames(nvcomp, stream, device, record: dict) -> None:
    """What nvCOMP does with frames that decode to fewer or more bytes than their header declares
    (``lying_frame``, what the engine's start check feeds it): into its own output (the size it
    reports) and into a preallocated one (does it raise, or leave the tail as it was)."""
    plane_len = 512 << 10
    nv = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, cuda_stream=stream.cuda_stream)
    for how, change in (("fewer", -4096), ("more", 4096)):
        frame = lying_frame(plane_len, plane_len + change)
        PlanesZstdCodec().check_frame(frame, plane_len)  # the host's check passes it
        source = torch.frombuffer(bytearray(frame), dtype=torch.uint8).to(device)

        def own(how=how, source=source) -> None:
            returned = nv.decode(nvcomp.as_arrays([source], cuda_stream=stream.cuda_stream))
            torch.cuda.synchronize()
            size = torch.as_tensor(returned[0], device=device).numel()
            record[f"{how}_frame_own"] = f"no error; decoded to {size} of {plane_len} declared"

        def into(how=how, source=source, sized=False) -> None:
            guarded = torch.full((plane_len + 2 * 65536,), 0xAB, dtype=torch.uint8, device=device)
            out = guarded[65536:65536 + plane_len]  # 64 KiB guards each side: writes outside the output?
            extra = {"decompression_config": nv.decompression_config(nv.compression_config([plane_len]))} \
                if sized else {}
            nv.decode(nvcomp.as_arrays([source], cuda_stream=stream.cuda_stream),
                      out=nvcomp.as_arrays([out], cuda_stream=stream.cuda_stream), **extra)
            torch.cuda.synchronize()
            outside = int((guarded[:65536] != 0xAB).sum() + (guarded[-65536:] != 0xAB).sum())
            record[f"{how}_frame_{'sized' if sized else 'into'}"] = \
                f"no error; {int((out[-4096:] == 0xAB).sum())} of the last 4096 bytes left as they were, " \
                f"{outside} guard bytes written"

        _guarded(record, f"{how}_frame_own", own)
        _guarded(record, f"{how}_frame_into", into)
        _guarded(record, f"{how}_frame_sized", lambda how=how, source=source: into(how, source, True))
        # a later good decode after the lying one: does an error surface late (a sticky status)?
        _guarded(record, f"{how}_then_good", lambda: good_after(nv, nvcomp, stream, device, record, how))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", default=None,
                        help="nvCOMP wheels (default .device/nvcomp, else /tmp/pykv-device/nvcomp)")
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
    reference: list[torch.Tensor] = []
    for variant in ("as_arrays",):  # run 20: a plain list of Arrays is a TypeError
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
            reference = [d.view(torch.uint8).reshape(-1) for d in decoded]
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
    if reference:
        probe_into_outputs(nvcomp, stream, inputs, reference, payload.nbytes, record)
    probe_lying_frames(nvcomp, stream, device, record)
    print(json.dumps(record))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
