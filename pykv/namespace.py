"""Namespaces: the fingerprint of everything that makes KV bytes incompatible.

Two engines share cache files only when every field below is equal: model
(what the model is, e.g. a fingerprint of its files, not the path it was given
by), dtype, KV layout, tokens per storage block, TP size and rank, PP rank, the
on-disk format version and the ``extra`` facts (the connector adds vLLM's
block-hash seed, among others). The fingerprint is the first 16 bytes of
xxh3-128 over the canonical JSON of those fields; its hex form names the
namespace directory. ``label`` (the model as the first writer named it) is
shown to people and not part of the fingerprint.

A codec other than ``none`` (``pykv.codec``) is the extra fact ``codec``: its
``params``, so engines storing blocks differently never share them, while an
engine of codec ``none`` keeps the fingerprint (and ``namespace.json``) of
pykv before codecs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, Mapping

import xxhash

from pykv.errors import InputError
from pykv.format import FORMAT_VERSION
from pykv.format_codec import NONE, valid_params

CODEC_FACT = "codec"
"""The ``extra`` key holding a namespace's codec ``params`` (absent for ``none``)."""


@dataclass(frozen=True)
class Namespace:
    """What a block's bytes depend on. ``extra`` holds further deciding facts (sorted pairs)."""

    model: str
    dtype: str
    kv_layout: str
    tokens_per_block: int
    tp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    format_version: int = FORMAT_VERSION
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    label: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.tokens_per_block <= 0:
            raise InputError(f"tokens_per_block: must be positive, got {self.tokens_per_block}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise InputError(f"tp_rank: {self.tp_rank} is outside tp_size {self.tp_size}")
        object.__setattr__(self, "extra", tuple(sorted((str(k), str(v)) for k, v in self.extra)))
        codec = dict(self.extra).get(CODEC_FACT)
        if codec is not None and not valid_params(codec):  # ``none`` included: it is never a fact
            raise InputError(f"extra.{CODEC_FACT}: {codec[:80]!r} is not a codec's params other than {NONE!r}")

    @property
    def codec(self) -> str:
        """The ``params`` of the codec this namespace's blocks are stored with (``none``: as they are)."""
        return dict(self.extra).get(CODEC_FACT, NONE)

    @staticmethod
    def codec_facts(params: str) -> dict[str, str]:
        """The ``extra`` facts naming codec ``params``: none for ``none`` (the fingerprint before codecs)."""
        return {} if params == NONE else {CODEC_FACT: params}

    def describe(self) -> dict[str, Any]:
        """The fields as a JSON-ready mapping (what ``namespace.json`` holds)."""
        data = asdict(self)
        data["extra"] = dict(self.extra)
        return data

    @cached_property
    def fingerprint(self) -> bytes:
        """16 bytes identifying this namespace (computed once: the worker asks for every block)."""
        identity = self.describe()
        del identity["label"]
        canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_digest(canonical.encode())

    @cached_property
    def id(self) -> str:
        """Hex fingerprint: the namespace's directory name."""
        return self.fingerprint.hex()

    @classmethod
    def from_description(cls, data: Mapping[str, Any]) -> "Namespace":
        """Inverse of ``describe`` (used to read ``namespace.json``)."""
        fields = dict(data)
        fields.pop("id", None)
        fields["extra"] = tuple(dict(fields.get("extra") or {}).items())
        try:
            return cls(**fields)
        except TypeError as exc:
            raise InputError(f"namespace description: {exc}") from exc
