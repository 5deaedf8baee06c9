"""``pykv bench --codec``: what each block codec makes of KV on this host, and what a disk hit
could then reach.

Each codec stores and restores one block of KV-like bf16 (``kv_like_bf16``: deterministic,
Gaussian K/V scaled per page, head and K/V, outlier channels, RoPE-rotated K) of the bench's
block size: its stored/raw ratio and its encode and decode GB/s of KV. ``planes-zstd`` runs on
``threads`` threads (as the engine's codec stage); ``fp8`` runs its torch functions on the CPU
(torch on ``threads`` threads) and, when CUDA is available, on the GPU (as engines run it).
A load reads ``ratio`` of the bytes and decodes them pipelined with the reads, as the engine
does, so it could reach ``min(R / ratio, decode GB/s)`` of KV where the medium reads R raw.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from collections.abc import Callable, Iterable, Sequence

from pykv.codec import CODEC_NAMES, UnknownCodecError

MIN_SECONDS = 0.2
"""Each timing repeats its operation until this long has passed (once at least)."""


@dataclass(frozen=True)
class CodecFigures:
    """One codec on one device: ``ratio`` = stored / raw bytes; speeds in GB/s of KV (None: not coded)."""

    codec: str
    device: str  # "cpu" | "cuda"
    threads: int | None
    ratio: float
    encode_gb_per_s: float | None
    decode_gb_per_s: float | None
    load_gb_per_s: float | None  # what a disk hit could reach (None: no raw read pass measured)

    def as_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def parse_codecs(values: Iterable[str]) -> list[str]:
    """The codec names of repeated and comma-separated ``--codec`` values, in order, once each;
    ``UnknownCodecError`` (one line naming the known ones) for any other name."""
    names: list[str] = []
    for value in values:
        for name in (part.strip() for part in value.split(",")):
            if name not in CODEC_NAMES:
                raise UnknownCodecError(f"--codec: unknown codec {name!r} (known: {', '.join(CODEC_NAMES)})")
            if name not in names:
                names.append(name)
    return names


def load_estimate(read_gb_per_s: float | None, ratio: float, decode_gb_per_s: float | None) -> float | None:
    """KV GB/s a load could reach reading ``ratio`` of the bytes at ``read_gb_per_s`` with decoding
    pipelined behind the reads: the slower of the two (no decode: the reads alone)."""
    if read_gb_per_s is None:
        return None
    reads = read_gb_per_s / ratio
    return reads if decode_gb_per_s is None else min(reads, decode_gb_per_s)


def kv_like(pages: int, heads: int = 8, tokens: int = 16, head_dim: int = 128, seed: int = 0):
    """Deterministic KV-like float32 values, ``pages`` x [heads, tokens, 2, head_dim] flat (vLLM's
    layout): Gaussian scaled per (page, head, K/V), a few K channels with outliers, K's channel
    pairs rotated as RoPE does. (The codec tests draw their payloads from it too.)"""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(pages, heads, tokens, 2, head_dim, generator=g)
    x *= torch.exp(torch.randn(pages, heads, 1, 2, 1, generator=g) * 0.7)
    x[:, :, :, 0, : head_dim // 16] *= 8
    angle = torch.arange(tokens)[:, None] * 10000 ** (-torch.arange(head_dim // 2) / (head_dim // 2))
    k = x[:, :, :, 0]
    a, b = k[..., 0::2].clone(), k[..., 1::2].clone()
    k[..., 0::2], k[..., 1::2] = a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()
    return x.reshape(-1)


def kv_like_bf16(nbytes: int, seed: int = 0, *, heads: int = 8, tokens: int = 16, head_dim: int = 128) -> bytes:
    """``nbytes`` (even) of ``kv_like`` values in bf16 (whole pages, cut to length)."""
    import torch

    values = nbytes // 2
    pages = -(-values // (heads * tokens * 2 * head_dim))
    x = kv_like(pages, heads, tokens, head_dim, seed)
    return x[:values].to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


def _speed(nbytes: int, op: Callable[[], object], sync: Callable[[], object] = lambda: None,
           min_seconds: float = MIN_SECONDS) -> float:
    """GB/s of ``nbytes`` per call of ``op`` (once untimed first; ``sync`` waits for a device)."""
    op()
    sync()
    runs, started = 0, time.perf_counter()
    while True:
        op()
        runs += 1
        sync()
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds:
            return nbytes * runs / elapsed / 1e9


def _planes_zstd(payload: bytes, threads: int, min_seconds: float) -> tuple[float, float, float]:
    from pykv.codec.lossless import PlanesZstdCodec

    codec = PlanesZstdCodec(threads=threads)
    try:
        stored, out = codec.encode(payload), bytearray(len(payload))
        codec.decode(stored, out)
        if out != payload:
            raise RuntimeError("planes-zstd did not restore the bench payload")
        return (len(stored) / len(payload), _speed(len(payload), lambda: codec.encode(payload), min_seconds=min_seconds),
                _speed(len(payload), lambda: codec.decode(stored, out), min_seconds=min_seconds))
    finally:
        codec.close()


def _fp8_zstd(payload: bytes, threads: int, min_seconds: float) -> tuple[float, float, float]:
    """fp8-zstd's ratio, and its zstd layer's speeds on the host in GB/s of KV (the codec threads'
    share of a store; a load's frames where nvCOMP is missing): fp8's own step is ``_fp8``'s."""
    from pykv.codec.fp8_zstd import Fp8ZstdCodec

    codec = Fp8ZstdCodec(threads=threads)
    try:
        inner = codec.fp8.encode(payload)
        stored, out = codec.frames.encode(inner), bytearray(len(inner))
        codec.frames.decode(stored, out)
        if out != inner:
            raise RuntimeError("fp8-zstd did not restore the bench payload's fp8 bytes")
        return (len(stored) / len(payload),
                _speed(len(payload), lambda: codec.frames.encode(inner), min_seconds=min_seconds),
                _speed(len(payload), lambda: codec.frames.decode(stored, out), min_seconds=min_seconds))
    finally:
        codec.close()


def _fp8(payload: bytes, device: str, threads: int, min_seconds: float) -> tuple[float, float, float]:
    import torch

    from pykv.codec.fp8 import DEFAULT_GROUP, Fp8Codec, dequantize, quantize

    ratio = Fp8Codec("bfloat16", DEFAULT_GROUP).stored_length(len(payload)) / len(payload)
    values = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(torch.bfloat16).to(device)
    out = torch.empty_like(values)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    previous = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(threads)
    try:
        codes, scales, _ = quantize(values, DEFAULT_GROUP)
        return (ratio, _speed(len(payload), lambda: quantize(values, DEFAULT_GROUP), sync, min_seconds),
                _speed(len(payload), lambda: dequantize(codes, scales, out, DEFAULT_GROUP), sync, min_seconds))
    finally:
        torch.set_num_threads(previous)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available()


def bench_codecs(names: Sequence[str], *, block_size: int, threads: int, read_gb_per_s: float | None,
                 min_seconds: float = MIN_SECONDS) -> list[CodecFigures]:
    """Each codec of ``names`` on one block of ``kv_like_bf16(block_size)`` (fp8 also on CUDA when
    there is one), with the load estimate against the medium's ``read_gb_per_s``."""
    payload = kv_like_bf16(block_size) if any(name != "none" for name in names) else b""
    figures = []
    for name in names:
        runs: list[tuple[str, int | None, tuple[float, float | None, float | None]]]
        if name == "none":
            runs = [("cpu", None, (1.0, None, None))]
        elif name == "planes-zstd":
            runs = [("cpu", threads, _planes_zstd(payload, threads, min_seconds))]
        elif name == "fp8-zstd":
            runs = [("zstd layer", threads, _fp8_zstd(payload, threads, min_seconds))]
        else:
            runs = [("cpu", threads, _fp8(payload, "cpu", threads, min_seconds))]
            if cuda_available():
                runs.append(("cuda", None, _fp8(payload, "cuda", threads, min_seconds)))
        for device, used, (ratio, encode, decode) in runs:
            figures.append(CodecFigures(name, device, used, ratio, encode, decode,
                                        load_estimate(read_gb_per_s, ratio, decode)))
    return figures


def gb(value: float) -> str:
    """A GB/s figure with two significant digits or more."""
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}" if value >= 1 else f"{value:.2f}" if value >= 0.1 \
        else f"{value:.3f}"


def describe(figures: dict, read_gb_per_s: float | None) -> str:
    """One line of ``CodecFigures.as_dict()``: ratio, speeds, and the load estimate."""
    name, ratio, decode = figures["codec"], figures["ratio"], figures["decode_gb_per_s"]
    if name == "none":
        line = f"{name}: all of the bytes"
    else:
        where = f" ({figures['device']})" if name.startswith("fp8") else ""
        on = f"{figures['threads']} threads" if figures["threads"] else "the GPU"
        line = (f"{name}{where}: {ratio:.2f} of the bytes; encode {gb(figures['encode_gb_per_s'])} GB/s, "
                f"decode {gb(decode)} GB/s on {on}")
    if read_gb_per_s is None:
        return line + "; no raw read pass measured: no load estimate"
    if name == "none":
        return line + f"; a load could reach {gb(read_gb_per_s)} GB/s of KV here (the reads)"
    reads, load = read_gb_per_s / ratio, figures["load_gb_per_s"]
    capped = "capped by decoding" if decode < reads else "capped by the reads"
    verdict = (f"{load / read_gb_per_s:.2f}x raw, the codec is faster" if load > read_gb_per_s * 1.02 else
               "raw is faster" if load < read_gb_per_s * 0.98 else "about the same as raw")
    return (line + f"; a load could reach {gb(load)} GB/s of KV here (reads {gb(read_gb_per_s)} GB/s "
                   f"/ {ratio:.2f} = {gb(reads)}, {capped}) vs {gb(read_gb_per_s)} raw: {verdict}")


def medium_read(results: Sequence[dict]) -> tuple[float | None, str | None]:
    """The medium's read GB/s for the estimate: the fastest raw pykv read pass (not the reactor's
    files, not fio) at the deepest depth, over all devices when there are several; and its name."""
    raw = [r for r in results if r["op"] == "read" and r["engine"] in ("pykv io_uring", "pykv threadpool")
           and r.get("device") in (None, "all")]
    if not raw:
        return None, None
    deepest = max(r["depth"] for r in raw)
    best = max((r for r in raw if r["depth"] == deepest), key=lambda r: r["gb_per_s"])
    return best["gb_per_s"], f"{best['engine']} read, depth {deepest}"
