"""A tiny random-weights Llama checkpoint for the demo and end-to-end tests (no hub access).

Every byte comes from this module: the weights are drawn from numpy's PCG64 bit generator
(its raw stream is fixed by the algorithm; no distribution method, no torch or transformers
initializer that a library upgrade could change), rounded to bfloat16 by bit arithmetic, and
written as safetensors and ``config.json`` by hand. ``pykv-test-model.json`` records the seed
and the xxh3-64 of the safetensors file, so a test can pin the exact weights a seed gives.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
from pathlib import Path

import numpy as np
import xxhash

from pykv.io.atomic import write_atomically

TINY_LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=4096,
                  bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                  initializer_range=0.1)  # 0.02 makes greedy output nearly input-independent
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "pykv-test-model.json"


def tensor_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in the fixed order the generator draws them."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes += [(f"{layer}.input_layernorm.weight", (hidden,)),
                   (f"{layer}.self_attn.q_proj.weight", (q_dim, hidden)),
                   (f"{layer}.self_attn.k_proj.weight", (kv_dim, hidden)),
                   (f"{layer}.self_attn.v_proj.weight", (kv_dim, hidden)),
                   (f"{layer}.self_attn.o_proj.weight", (hidden, q_dim)),
                   (f"{layer}.post_attention_layernorm.weight", (hidden,)),
                   (f"{layer}.mlp.gate_proj.weight", (inter, hidden)),
                   (f"{layer}.mlp.up_proj.weight", (inter, hidden)),
                   (f"{layer}.mlp.down_proj.weight", (hidden, inter))]
    return shapes + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even (finite inputs)."""
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def generate_tensors(config: dict, seed: int) -> list[tuple[str, tuple[int, ...], np.ndarray]]:
    """(name, shape, bfloat16 bits): norms are ones; every matrix is uniform with standard
    deviation ``initializer_range``, from the PCG64 raw stream (53 bits per value)."""
    generator = np.random.PCG64(seed)
    half_width = config["initializer_range"] * math.sqrt(3.0)
    tensors = []
    for name, shape in tensor_shapes(config):
        count = math.prod(shape)
        if name.endswith("norm.weight"):
            values = np.ones(count, dtype=np.float64)
        else:
            unit = (generator.random_raw(count) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
            values = (unit * 2.0 - 1.0) * half_width
        tensors.append((name, shape, bfloat16_bits(values.astype(np.float32))))
    return tensors


def safetensors_bytes(tensors: list[tuple[str, tuple[int, ...], np.ndarray]]) -> bytes:
    """The safetensors file: u64 header length, JSON header (space-padded to 8), raw little-endian data."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, bits in tensors:
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + bits.nbytes]}
        offset += bits.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *(bits.astype("<u2").tobytes() for _, _, bits in tensors)])


def hf_config(config: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False,
            "mlp_bias": False, "use_cache": True, **config}


def make_tiny_llama(directory: Path, seed: int = 0) -> Path:
    """Write the checkpoint into ``directory`` once (idempotent); return the directory."""
    directory = Path(directory)
    if (directory / MANIFEST_FILE).exists() and (directory / WEIGHTS_FILE).exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    weights = safetensors_bytes(generate_tensors(TINY_LLAMA, seed))
    write_atomically(directory / "config.json", json.dumps(hf_config(TINY_LLAMA), indent=1), durable=False)
    write_atomically(directory / WEIGHTS_FILE, weights, durable=False)
    manifest = {"seed": seed, "weights": WEIGHTS_FILE, "weights_xxh3_64": xxhash.xxh3_64_hexdigest(weights),
                **TINY_LLAMA}
    # last: marks the checkpoint complete
    write_atomically(directory / MANIFEST_FILE, json.dumps(manifest), durable=False)
    return directory


def main(argv: list[str] | None = None) -> int:
    """``python -m pykv.jobs.tiny_model DIR [--seed N]``: write the checkpoint, print its directory."""
    parser = argparse.ArgumentParser(prog="python -m pykv.jobs.tiny_model",
                                     description="Write the tiny random-weights Llama checkpoint of the demo and "
                                                 "the end-to-end tests into DIR (made if missing; kept if it "
                                                 "already holds one).")
    parser.add_argument("directory", metavar="DIR", type=Path, help="where to write config.json and the weights")
    parser.add_argument("--seed", metavar="N", type=int, default=0, help="weights seed (default: 0, the tests')")
    args = parser.parse_args(argv)
    if str(args.directory).startswith("-"):  # after ``--``: a typo for an option, not a directory name
        parser.exit(2, f"{parser.prog}: error: DIR {str(args.directory)!r} looks like an option; "
                       f"write ./{args.directory} for a directory of that name\n")
    print(make_tiny_llama(args.directory, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
