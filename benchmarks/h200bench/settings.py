"""The benchmark's constants: storage block, model shapes, anchors, targets, stages, host paths.

Every host path here is a default; the options of ``h200_connector.py stage`` (and the
environment variables of ``h200_run.sh``) override them (benchmarks/README.md, "Host
paths and settings").
"""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent
REPO = BENCHMARKS.parent
GIB = 1 << 30
CHUNK = 256  # tokens per storage block (one file)
WARMUP_TOKENS = 1024

# -- host paths (defaults of options) ---------------------------------------------------------------
WORK_DIR = "/tmp/pykv-h200"
"""``--work``: results.jsonl, logs, stats, engine configs, model config (``PYKV_H200_WORK``)."""
DEVICE_PARTS_DIR = "/tmp/pykv-device"
"""``--device-parts``: where the device commands put the carried vLLM parts (part2 holds mk_model.py)."""
SHM_DIR = "/dev/shm"
"""``--shm``: where loop images and stage M's tree live (a tmpfs)."""
MOUNT_BASE = "/mnt"
"""``--mount-base``: loop devices are mounted on ``MOUNT_BASE/pykv-h200-NAME``."""
DISK_DIR_FALLBACK = "/var/tmp"
"""``--disk-dir`` unset: the block-device file system with the most free space, else this."""
NATIVE_REGION_DIR = "/dev/shm"
"""Where vLLM's native CPU tier maps its regions (``vllm_offload_*.mmap``; vLLM's choice)."""


def mk_model_candidates(device_parts: str) -> tuple[str, ...]:
    """``mk_model.py`` (writes the Llama-3.2-3B config) in the carried parts or the shared checkout."""
    return (f"{device_parts}/part2/mk_model.py", str(REPO.parent / "shared/device/mk_model.py"))


def mk_config_candidates(device_parts: str) -> tuple[str, ...]:
    """``mk_config.py`` for the 8B/32B shapes; ``prepare.sh`` does not pack ``anchors/``, so carry a
    copy in ``.device/extra/``."""
    return (f"{device_parts}/part2/anchors/mk_config.py", str(REPO / ".device/extra/mk_config.py"),
            str(REPO.parent / "shared/device/anchors/mk_config.py"))


# -- model shapes -------------------------------------------------------------------------------------
LLAMA_3_2_3B = {  # same as shared/device/mk_model.py --config-only (fallback when it is not at hand)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "num_attention_heads": 24, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}
LLAMA_3_2_3B_KV_BYTES_PER_TOKEN = 114688  # dry runs, where no config is written
CAL_SHAPES = {"8b": "llama8b", "32b": "qwen32b"}  # calibration shapes besides the 3B (mk_config.py names)
SHAPE_KV_BYTES_PER_TOKEN = {"3b": LLAMA_3_2_3B_KV_BYTES_PER_TOKEN, "8b": 131072, "32b": 262144}  # dry runs

# -- what the report compares against ------------------------------------------------------------------
# Anchors measured with the same method (shared/device/README.md), TTFT in seconds.
ANCHORS = {
    "recompute": {8192: 0.095, 32768: 0.62, 81920: 2.70},
    "native_cpu": {8192: 0.065, 32768: 0.124, 81920: 0.25},
    "native_fs/virtio": {8192: 0.54, 32768: 2.07, 81920: 4.98},
    "native_fs/loop": {8192: 0.29, 32768: 1.12, 81920: 2.73},
}
TARGETS = {"load_vs_odirect": 0.90, "dram_vs_native_cpu": 1.05, "fs_vs_pykv_loop": 1.5}
# Issue 17 (stages S1-S3): striping over 8 loop devices.
STRIPE_TARGETS = {
    "load_vs_aggregate_odirect": 0.85,  # pykv's load bandwidth / aggregate O_DIRECT reads of the set
    "ttft_max_s": {32768: 0.25, 81920: 0.6},  # disk hit on the set
    "vs_native_one_device": 4.0,  # native fs (one device) TTFT / pykv on the set
    "one_device_vs_native_best": 1.2,  # native fs at its best / pykv on one device, at 32k and 80k
    "one_device_lengths": (32768, 81920),
    "gate_tolerance": 1.05,
}
# Issue 19 (stage I): decode inter-token latency with pykv working in the background, over the
# same run without a connector and with vLLM's native offloading (mean and p99, the stream's window).
ITL_TARGETS = {"vs_none": 1.02, "vs_native": 1.0}

ENGINE_ENV = {
    "PYTHONHASHSEED": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
    # NVLink multicast stays off on the shared multi-GPU hosts (the device notes): NCCL, PyTorch's
    # symmetric memory and NVSHMEM, and vLLM's all-reduce through symmetric memory (TP > 1)
    "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
}

# -- stages -----------------------------------------------------------------------------------------------
STAGES = ("A", "B", "C", "D", "L", "K", "M")
"""What ``all`` runs."""
STRIPE_STAGES = ("S1", "S2", "S3", "S4", "S5")
"""Issue 17's stages (``striping``, S5 ``verify_stage``) and issue 20's S4 on the same devices: named on their own, not part of ``all``."""
TP_STAGES = ("T", "T1", "T2")
"""Issue 19's stages (``tp_stage``): pykv at tensor parallelism ``--tp``; named on their own."""
PEER_STAGES = ("LM",)
"""Issue 38's stage (``lmcache_stage``): LMCache beside pykv; named on its own (it needs its wheels carried)."""
# Seconds the required (non-optional) part of each stage takes on the H200 host, roughly: an
# optional engine runs only when this much is left for the stages after it.
STAGE_REQUIRED_S = {"A": 240, "B": 200, "C": 160, "D": 170, "L": 60, "K": 400, "M": 180,
                    "S1": 420, "S2": 300, "S3": 420, "S4": 300, "S5": 400, "T1": 330, "T2": 170, "T": 500,
                    "LM": 300}
