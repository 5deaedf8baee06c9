"""Where a ``planes-zstd`` device step spends its time, op by op, outside vLLM (H200/H100 host).

The engine's lossless loads ran ~10 GB/s of KV (runs 21-26) and the 8-device target needs ~22.
This times each part of a step on its own, with CUDA events, for several zstd chunk sizes (the
codec's ``chunk``: 1 MiB by default, 2 frames each) and blocks per step: the host's layout
(every table and frame header read: ``device_zstd.step_layout``, the engine's), the stored
bytes' copy to the device (whole, one range per block, as the engine's), zeroing the rows,
nvCOMP's batched decode in each of ``--modes`` (``sized``: the Python API, an object per frame;
``batched``: the C API, one table per step; host time of the call and device time apart), the
raw planes' gather (``device_zstd.RawPlanes``, the engine's), and three ways to merge the byte
planes into values (the engine's transposed copy; two strided copies; int16 arithmetic), each
checked against the source KV (run 28: docs/benchmarks.md).
Prints GB/s of KV per part and one JSON line per (chunk, step) to ``--out``.

    python3 benchmarks/h200_zstd_steps.py --out $OUT/zstd_steps.jsonl
    python3 benchmarks/h200_zstd_steps.py --cpu --blocks 2 --chunk-kib 1024   # smoke test of this script
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from pykv.codec.lossless import PlanesZstdCodec
from pykv.connector.device_zstd import RawPlanes, step_layout
from pykv.connector.zstd_frames import HostFrames, NvcompFrames

BLOCK = 28 * 65_536 * 16  # the 3B shape's storage block: 29.4 MB of bf16 KV


class Clock:
    """Seconds of device work per named part (CUDA events; wall time on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds = device, {}
        self._pending: list[tuple[str, object, object]] = []

    def part(self, name: str, work) -> object:
        if self.device.type != "cuda":
            began = time.perf_counter()
            result = work()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began
            return result
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = work()
        end.record()
        self._pending.append((name, start, end))
        return result

    def settle(self) -> dict[str, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        for name, start, end in self._pending:
            self.seconds[name] = self.seconds.get(name, 0.0) + start.elapsed_time(end) / 1e3
        self._pending.clear()
        return self.seconds


def merges(rows: torch.Tensor, count: int, raw: int) -> dict[str, callable]:
    """Three ways to turn rows (plane 0 then plane 1 of each block) into little-endian values."""
    planes = rows.view(count, 2, raw // 2)
    out = torch.empty(count, raw, dtype=torch.uint8, device=rows.device)
    values = out.view(count, raw // 2, 2)

    def transposed():
        values.copy_(planes.transpose(1, 2))

    def strided():
        values[:, :, 0].copy_(planes[:, 0])
        values[:, :, 1].copy_(planes[:, 1])

    def arithmetic():
        wide = planes[:, 1].to(torch.int32).bitwise_left_shift_(8).bitwise_or_(planes[:, 0].to(torch.int32))
        out.view(torch.int16).copy_(wide.to(torch.int16))  # low 16 bits: the value's bytes
    return {"merge_transposed": transposed, "merge_strided": strided, "merge_arithmetic": arithmetic}, out


def run(stored: list[np.ndarray], codec: PlanesZstdCodec, kv: np.ndarray, step: int, device: torch.device,
        decoders: dict) -> dict:
    """Each step: the host's layout (``step_layout``, as the engine's), the blocks' stored bytes
    to the device as they are (one page-locked buffer, one copy), then per decoder: rows zeroed,
    the frames decoded, the raw planes gathered (``RawPlanes``, the engine's), the rows merged
    (each merge, after the last decoder) and checked against the source KV."""
    blocks = len(stored)
    clock, walk_s, frames_total, raw_total, wrong = Clock(device), 0.0, 0, 0, {}
    calls = dict.fromkeys(decoders, 0.0)
    stored_row = codec.encoded_bound(BLOCK)
    raw_planes = RawPlanes(codec, step * BLOCK, device)
    for first in range(0, blocks, step):
        group = stored[first:first + step]
        count = len(group)
        began = time.perf_counter()
        layout = step_layout(codec, group, BLOCK, stored_row)
        walk_s += time.perf_counter() - began
        frames_total, raw_total = frames_total + len(layout.frames), raw_total + len(layout.raw)
        host = torch.empty(count * stored_row, dtype=torch.uint8, pin_memory=device.type == "cuda")
        for row, _, _, to, length in layout.moves.tolist():
            host[to:to + length] = torch.from_numpy(group[row])
        source = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        rows = torch.empty(count * BLOCK, dtype=torch.uint8, device=device)
        clock.part("h2d_all_stored", lambda: source.copy_(host, non_blocking=True))
        want = torch.from_numpy(kv[first:first + count]).to(device)
        ways, out = merges(rows, count, BLOCK)
        for name, decoder in decoders.items():
            clock.part("zero_rows", rows.zero_)
            began = time.perf_counter()
            clock.part(f"decode_{name}", lambda: decoder.decode(source, layout.frames, rows, layout.outputs))
            calls[name] += time.perf_counter() - began
            clock.part("raw_planes_gather", lambda: raw_planes.place(source, rows.view(count, BLOCK), layout.raw))
            for merge, way in ways.items():
                if merge != "merge_transposed" and name != list(decoders)[-1]:
                    continue
                out.zero_()
                clock.part(merge if merge != "merge_transposed" else f"{merge}_{name}", way)
                clock.settle()
                key = f"{merge}_{name}" if merge == "merge_transposed" else merge
                wrong[key] = wrong.get(key, 0) + int((out != want).any(dim=1).sum())
    seconds = clock.settle()
    kv_bytes = blocks * BLOCK
    return {"frames": frames_total, "raw_planes": raw_total, "host_walk_s": round(walk_s, 4),
            **{f"host_decode_call_s_{name}": round(s, 4) for name, s in calls.items()},
            **{f"{name}_gbps_of_kv": float(f"{kv_bytes / s / 1e9:.3g}") for name, s in seconds.items() if s > 0},
            "wrong_blocks": wrong}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=24, help="storage blocks of 29.4 MB")
    parser.add_argument("--chunk-kib", default="1024,256,64", help="comma list of the codec's chunk sizes")
    parser.add_argument("--steps", default="3,8,24", help="comma list of blocks per step")
    parser.add_argument("--modes", default="sized,batched", help="nvCOMP modes timed (zstd_frames.NvcompFrames)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--cpu", action="store_true", help="a smoke test of this script (zstandard on the host)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    generator = torch.Generator().manual_seed(38)
    kv = (torch.randn(args.blocks, BLOCK // 2, generator=generator) * 0.02).to(torch.bfloat16)
    kv = kv.view(torch.uint8).numpy().reshape(args.blocks, BLOCK)  # dummy-weight-like bf16 KV, as bytes
    for chunk in (int(x) << 10 for x in args.chunk_kib.split(",")):
        codec = PlanesZstdCodec(chunk=chunk, threads=8)
        stored = []
        for block in kv:
            buffer = np.empty(codec.encoded_bound(BLOCK), dtype=np.uint8)
            stored.append(buffer[:codec.encode(block, buffer)])
        ratio = round(sum(len(s) for s in stored) / kv.size, 4)
        decoders = {"host": HostFrames(codec)} if args.cpu else {}
        for mode in ([] if args.cpu else args.modes.split(",")):
            decoders[mode] = NvcompFrames(device, None)
            decoders[mode].mode = mode
        for step in (int(x) for x in args.steps.split(",")):
            record = {"kind": "zstd_steps", "chunk": chunk, "ratio": ratio, "step_blocks": step, "blocks": args.blocks,
                      "device": torch.cuda.get_device_name() if not args.cpu else "cpu"}
            try:
                record.update(run(stored, codec, kv, step, device, decoders))
            except Exception as exc:  # noqa: BLE001 - reported; the next setting runs
                record["error"] = f"{type(exc).__name__}: {exc}"[:600]
            print(json.dumps(record), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")
        codec.close()


if __name__ == "__main__":
    main()
