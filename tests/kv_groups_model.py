"""A tiny random Llama whose layers alternate sliding-window and full attention: vLLM gives it
two KV cache groups. Weights come from numpy (seeded), written as safetensors with a config.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 512, 4, 4, 2, 64, 1024
SLIDING_WINDOW = 128
LAYER_TYPES = ["sliding_attention", "full_attention"] * (LAYERS // 2)

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    "layer_types": LAYER_TYPES, "sliding_window": SLIDING_WINDOW,
}


def make_two_group_llama(directory: Path, seed: int = 0) -> Path:
    """Write the checkpoint into ``directory`` (idempotent); return the directory."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.1, size=shape).astype(np.float32)  # 0.1: greedy output depends on the input

    tensors = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN), "model.norm.weight": np.ones(HIDDEN, np.float32),
               "lm_head.weight": normal(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE),
        })
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=1))
    return directory
