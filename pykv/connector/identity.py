"""What a namespace is keyed on beyond the KV layout: the model's identity and the block-hash seed.

**Model.** Two engines share blocks only when they run the same weights, wherever
those lie. A local directory (or file) is identified by its content: the canonical
``config.json`` plus a cheap fingerprint of the weight files (name, size, and xxh3 of
the first and last MiB). A copy in another directory shares the tree; two fine-tunes
with the same config never do. A hub id that is not a local directory is identified
by its cached snapshot directory when ``huggingface_hub`` has one (offline lookup),
else by ``hub:<id>@<revision>`` (``@default`` when no revision is pinned: a hub
model that changes under the same id and revision would share; pin a revision).

**Block-hash seed.** vLLM chains block hashes from ``NONE_HASH = hash_fn(seed)``
(``vllm/v1/core/kv_cache_utils.py``, ``init_none_hash``): the seed is
``$PYTHONHASHSEED`` when set; when unset, vLLM 0.32+ uses a fixed default for
cryptographic algorithms (sha256, the default) and a random per-process seed
otherwise, older versions always a random one. Engines with different seeds never
compute the same keys, so they get different namespaces (``inspect`` shows the
split). The fingerprint is computed from the environment as vLLM computes
``NONE_HASH`` (the engine initializes it after pykv's scheduler side starts, and
worker processes never do); a random seed gets a namespace of its own engine
(``random:<engine id>``), which no other engine can share.
"""

from __future__ import annotations

import json
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import xxhash

log = logging.getLogger("pykv")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
EDGE_BYTES = 1 << 20  # bytes hashed at each end of a weight file
SEED_ENV = "PYTHONHASHSEED"


# -- the model ----------------------------------------------------------------------------------
def _file_fingerprint(path: Path, hasher: Any) -> None:
    size = path.stat().st_size
    hasher.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        hasher.update(f.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            f.seek(max(size - EDGE_BYTES, EDGE_BYTES))
            hasher.update(f.read(EDGE_BYTES))


@lru_cache(maxsize=16)
def local_model_identity(path: str) -> str:
    """``files:<config hash>:<weights hash>`` of a model directory (or single weights file)."""
    target = Path(path)
    weights = xxhash.xxh3_64()
    if target.is_file():
        _file_fingerprint(target, weights)
        return f"files:-:{weights.hexdigest()}"
    config = xxhash.xxh3_64()
    try:
        config.update(json.dumps(json.loads((target / "config.json").read_text()), sort_keys=True,
                                 separators=(",", ":")).encode())
    except (OSError, ValueError):
        config.update(b"(no config.json)")
    for file in sorted(p for p in target.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)):
        weights.update(f"{file.relative_to(target).parent}/".encode())
        _file_fingerprint(file, weights)
    return f"files:{config.hexdigest()}:{weights.hexdigest()}"


def _cached_snapshot(repo_id: str, revision: str | None) -> str | None:
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:  # not installed, not cached, not a repo id: fall back to the id
        return None


def model_identity(name: str, revision: str | None = None) -> str:
    """What the model *is* (see the module doc); ``name`` as given to vLLM."""
    if os.path.exists(name):
        return local_model_identity(os.path.realpath(name))
    snapshot = _cached_snapshot(name, revision)
    if snapshot is not None:
        return local_model_identity(os.path.realpath(snapshot))
    return f"hub:{name}@{revision or 'default'}"


# -- the block-hash seed ------------------------------------------------------------------------
def _resolved_seed(algo: str) -> str | None:
    """The seed vLLM derives ``NONE_HASH`` from in an engine with ``algo``; None: random per process."""
    seed = os.environ.get(SEED_ENV)
    if seed is not None:
        return seed
    from pykv.connector import compat
    return compat.default_none_hash_seed(algo)


def hash_seed_fingerprint(algo: str, engine_id: str) -> str:
    """A short hash of ``NONE_HASH`` (``hash_fn(seed)``), or ``random:<engine_id>`` when vLLM
    draws a random seed per process."""
    seed = _resolved_seed(algo)
    if seed is None:
        return f"random:{engine_id}"
    from pykv.connector import compat
    return xxhash.xxh3_64_hexdigest(compat.hash_fn_by_name(algo)(seed))


def current_engine_settings() -> tuple[str, str | None]:
    """(prefix-caching hash algorithm, model revision) of the engine being built in this process."""
    from pykv.connector import compat
    config = compat.current_vllm_config()
    if config is None:
        return "sha256", None
    return (getattr(config.cache_config, "prefix_caching_hash_algo", "sha256"),
            getattr(config.model_config, "revision", None))


_warned: set[str] = set()


def warn_about_seed(fingerprint: str) -> None:
    """One line per process when ``PYTHONHASHSEED`` is unset (what it means for sharing)."""
    if SEED_ENV in os.environ or "seed" in _warned:
        return
    _warned.add("seed")
    if fingerprint.startswith("random:"):
        log.warning("pykv: PYTHONHASHSEED is unset, so vLLM hashes blocks with a random seed: this engine can "
                    "neither load what other engines stored nor share what it stores (namespace of its own). "
                    "Start every engine of a tree with the same PYTHONHASHSEED (pykv serve sets 0).")
    else:
        log.warning("pykv: PYTHONHASHSEED is unset: this engine shares blocks only with engines that also leave "
                    "it unset (vLLM's default seed, seed fingerprint %s). Start every engine of a tree with the "
                    "same PYTHONHASHSEED (pykv serve sets 0).", fingerprint)
