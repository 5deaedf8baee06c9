"""A tiny random-weights Llama checkpoint for the demo and end-to-end tests (no hub access)."""

from __future__ import annotations

import json
from pathlib import Path

TINY_LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=4096,
                  bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                  initializer_range=0.1)  # 0.02 makes greedy output nearly input-independent


def make_tiny_llama(directory: Path, seed: int = 0) -> Path:
    """Write the checkpoint into ``directory`` once (idempotent); return the directory."""
    directory = Path(directory)
    if (directory / "config.json").exists() and any(directory.glob("*.safetensors")):
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**TINY_LLAMA)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    (directory / "pykv-test-model.json").write_text(json.dumps({"seed": seed, **TINY_LLAMA}))
    return directory


if __name__ == "__main__":
    import sys
    print(make_tiny_llama(Path(sys.argv[1])))
