"""The longest sequence a model takes, read from its directory's ``config.json`` before any engine starts.

vLLM refuses a ``max_model_len`` above the length the model's config derives (the smallest of
``max_position_embeddings``, ``n_positions``, ``max_seq_len``, ...; times a RoPE scaling factor
that does not already count in it) and a prompt that does not leave room for one generated token.
``config_limit`` mirrors that derivation (erring long where it is unsure, so it never refuses what
vLLM takes), ``engine_limit`` adds the engine's own ``max_model_len``, ``fit_lengths`` checks
calibration lengths against the limit. Pure: no vLLM, no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pykv.errors import InputError

LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
"""vLLM's keys for a model's length, smallest wins (``derive_max_model_len_and_key``)."""
SCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
"""RoPE types whose ``factor`` already counts in ``max_position_embeddings``."""
ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass(frozen=True)
class ModelLimit:
    """At most ``tokens`` per sequence (prompt + generated), as ``source`` says."""

    tokens: int
    source: str  # e.g. "max_position_embeddings in /models/m/config.json"

    def longest_length(self, block_tokens: int) -> int:
        """The longest calibration length that fits (a multiple of ``block_tokens``; 0 if none): its
        prompt of length + 1 tokens must be shorter than ``tokens`` (one token is generated)."""
        return max(0, (self.tokens - 2) // block_tokens * block_tokens)


def model_config(model: str) -> dict[str, Any] | None:
    """``model``'s ``config.json`` as a JSON object; None for a hub id or a file that is missing,
    unreadable or not an object."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (``text_config`` of a multimodal model, else all of it)."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def config_limit(model: str) -> ModelLimit | None:
    """The limit ``model``'s ``config.json`` derives; None for a hub id, a directory without a
    readable config, or a config naming no length (vLLM then takes the ``max_model_len`` given)."""
    config = model_config(model)
    if config is None:
        return None
    text = text_config(config)
    found = {key: text[key] for key in LENGTH_KEYS if _positive(text.get(key))}
    if not found:
        return None
    key = "model_max_length" if "model_max_length" in found else min(found, key=lambda k: found[k])
    tokens = found[key] * _rope_factor(text, str(config.get("model_type", "")))
    return ModelLimit(int(tokens), f"{key} in {Path(model) / 'config.json'}")


def engine_limit(model: str, engine_args: dict[str, Any]) -> ModelLimit | None:
    """The limit an engine of ``model`` with ``engine_args`` has: their ``max_model_len`` if given
    (refused above the config's limit unless vLLM is told to allow it), else the config's."""
    derived = config_limit(model)
    given = engine_args.get("max_model_len")
    if not _positive(given):  # absent, -1 (vLLM fits it to memory) or not a number: the config's
        return derived
    if derived is not None and given > derived.tokens and not _env_true(ALLOW_LONG_ENV):
        raise InputError(f"--engine-arg max_model_len: {given} exceeds the model's limit of {derived.tokens} "
                         f"tokens ({derived.source}); give at most {derived.tokens}, or set {ALLOW_LONG_ENV}=1")
    return ModelLimit(int(given), "max_model_len in the engine arguments")


def fit_lengths(lengths: list[int], limit: ModelLimit | None, block_tokens: int, *,
                defaults: bool = False) -> tuple[list[int], str | None]:
    """``lengths`` checked against ``limit``, and a note on what changed (or None).

    Given lengths that do not fit are refused naming them and the longest that fits; ``defaults``
    (the user gave none): those that do not fit are dropped and the longest that fits is added.
    """
    if limit is None:
        return lengths, None
    longest = limit.longest_length(block_tokens)
    too_long = [n for n in lengths if n > longest]
    if not too_long:
        return lengths, None
    what = f"the model's limit of {limit.tokens} tokens ({limit.source})"
    if longest == 0:
        raise InputError(f"--block-tokens: {block_tokens} leaves no length that fits {what}; a length L runs "
                         f"a prompt of L + 1 tokens and generates one")
    if not defaults:
        raise InputError(f"--lengths: {_listed(too_long)} {_do(too_long)} not fit {what}; "
                         f"give --lengths up to {longest} (a length L runs a prompt of L + 1 tokens and "
                         f"generates one)")
    kept = sorted({n for n in lengths if n <= longest} | {longest})
    return kept, (f"--lengths: measuring {_listed(kept)} tokens: the default lengths {_listed(too_long)} "
                  f"{_do(too_long)} not fit {what}")


def _rope_factor(config: dict[str, Any], model_type: str) -> float:
    """The RoPE scaling factor vLLM multiplies the config's length by (1.0 when none applies)."""
    if model_type.startswith("gemma3"):
        return 1.0
    factor = 1.0
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if not isinstance(value, dict):
            continue
        per_layer = [v for v in value.values() if isinstance(v, dict)]
        for params in per_layer or [value]:
            kind = params.get("rope_type") or params.get("type") or "default"
            if kind not in SCALED_ROPE and _positive(params.get("factor")):
                factor = float(params["factor"])
    return factor


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _env_true(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true")


def _do(values: list[int]) -> str:
    return "does" if len(values) == 1 else "do"


def _listed(values: list[int]) -> str:
    """``256``, ``256 and 512``, ``256, 512 and 1024``."""
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} and {text[-1]}"
