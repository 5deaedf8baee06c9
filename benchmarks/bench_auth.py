"""Host cost of authenticated loads: keyed BLAKE3 against xxh3-128 over the payloads of an 80k-token
hit of the Llama-3.2-3B shape (313 blocks of 28 MiB), best of ``--repeat`` passes.

    python benchmarks/bench_auth.py [--tokens 80000] [--threads 1,2] [--repeat 3]

Two views: the bare hash functions over one block (one thread; blake3 also with its own
threads, ``max_threads=AUTO``), and the reactor's verifier (``PayloadVerifier``) checking every
block of the hit on N threads, as ``verify=full`` (xxh3) and with ``auth_key_file`` (the MAC
alone, hashed on blake3's pool as pykv does, and on one thread per block as before) do. A few block buffers are reused, so memory stays small; the buffers are larger than
the CPU caches, so every pass reads from memory as a load does. No GPU, no disk.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import blake3
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pykv import auth  # noqa: E402
from pykv.auth import load_key_ring, write_key_file  # noqa: E402
from pykv.blockfile import encode_block  # noqa: E402
from pykv.format import HEADER_SIZE, Geometry, decode_header  # noqa: E402
from pykv.reactor.verify import PayloadVerifier  # noqa: E402

TOKENS_PER_BLOCK = 256
BYTES_PER_TOKEN = 2 * 28 * 8 * 128 * 2  # K and V, 28 layers, 8 KV heads, head dim 128, bf16: 112 KiB
BUFFERS = 4


def best(repeat: int, run) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def verify_all(verifier: PayloadVerifier, blocks: list, count: int) -> None:
    remaining = [count]
    done = threading.Event()
    lock = threading.Lock()

    def finished(failure) -> None:
        assert failure is None, failure
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set()
    for i in range(count):
        header, head, payload = blocks[i % len(blocks)]
        verifier.submit(header, head, payload, "bench", finished)
    done.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=80_000)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    geometry = Geometry(TOKENS_PER_BLOCK, 28 * 2, TOKENS_PER_BLOCK * BYTES_PER_TOKEN // 56)
    count = -(-args.tokens // TOKENS_PER_BLOCK)
    total = count * geometry.payload_length
    with tempfile.TemporaryDirectory() as work:
        write_key_file(Path(work) / "keys", {"bench": os.urandom(32)})
        keys = load_key_ring(Path(work) / "keys")
    blocks = []
    for i in range(BUFFERS):
        payload = os.urandom(geometry.payload_length)
        data = memoryview(encode_block(bytes(16), bytes([i]) * 32, geometry, payload, keys=keys))
        blocks.append((decode_header(data[:HEADER_SIZE]), data[:HEADER_SIZE], data[HEADER_SIZE:]))
    payloads = [payload for _, _, payload in blocks]
    print(f"{os.cpu_count()} CPUs; blake3 {blake3.__version__}, xxhash {xxhash.VERSION}; block "
          f"{geometry.payload_length / 2**20:.0f} MiB; {count} blocks = {args.tokens:,} tokens = {total / 1e9:.2f} GB")
    key = bytes(32)
    functions = {
        "xxh3-128": lambda data: xxhash.xxh3_128_digest(data),
        "blake3 keyed": lambda data: blake3.blake3(data, key=key).digest(),
        "blake3 keyed, max_threads=AUTO": lambda data: blake3.blake3(data, key=key,
                                                                     max_threads=blake3.blake3.AUTO).digest(),
    }
    print(f"\none call per block, the {BUFFERS} buffers in turn (GB/s)")
    for name, function in functions.items():
        seconds = best(args.repeat, lambda: [function(data) for data in payloads])
        print(f"  {name:<32} {BUFFERS * geometry.payload_length / seconds / 1e9:6.2f}")
    print(f"\nPayloadVerifier over the {args.tokens:,}-token hit: seconds (GB/s)")
    for threads in (int(t) for t in args.threads.split(",")):
        row = []
        for label, ring, hash_threads in (("xxh3 (verify=full)", None, None),
                                          ("MAC, one thread per block", keys, 1),
                                          ("MAC (auth_key_file)", keys, auth.HASH_THREADS)):
            saved, auth.HASH_THREADS = auth.HASH_THREADS, hash_threads or auth.HASH_THREADS
            verifier = PayloadVerifier(threads, ring)
            try:
                seconds = best(args.repeat, lambda: verify_all(verifier, blocks, count))
            finally:
                verifier.close()
                auth.HASH_THREADS = saved
            row.append(f"{label} {seconds:6.2f} s ({total / seconds / 1e9:5.2f})")
        print(f"  {threads} thread{'s' if threads > 1 else ' '}: " + "\n             ".join(row))


if __name__ == "__main__":
    main()
