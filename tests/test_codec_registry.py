"""``pykv/codec/registry.py`` and ``identity.py``: codecs chosen by name, unknown names refused
in one line, ``none`` stores the payload as it is."""

from __future__ import annotations

import pytest

from pykv.codec import CODEC_NAMES, CodecError, UnknownCodecError, codec_for
from pykv.codec.fp8 import PageShape
from pykv.errors import InputError


def test_every_name_gives_its_codec_with_distinct_params():
    page = PageShape(heads=8, tokens=16, head_dim=128)
    codecs = [codec_for(name, page=page) for name in CODEC_NAMES]
    assert [c.name for c in codecs] == list(CODEC_NAMES)
    assert len({c.params for c in codecs}) == len(codecs)
    assert all(c.params.startswith(c.name) for c in codecs)


def test_unknown_names_are_refused_in_one_line():
    with pytest.raises(UnknownCodecError) as refused:
        codec_for("gzip")
    message = str(refused.value)
    assert "\n" not in message and "'gzip'" in message and "none, planes-zstd, fp8" in message
    assert isinstance(refused.value, InputError)


def test_fp8_needs_the_page_shape():
    with pytest.raises(UnknownCodecError, match="page shape"):
        codec_for("fp8")


def test_identity_stores_the_payload_and_checks_the_length():
    codec = codec_for("none")
    payload = bytes(range(256)) * 3
    assert codec.encode(payload) == payload and codec.encoded_bound(len(payload)) == len(payload)
    out = bytearray(1000)
    assert codec.encode(payload, out) == len(payload) and bytes(out[: len(payload)]) == payload
    assert codec.decode_bytes(payload, len(payload)) == payload
    with pytest.raises(CodecError, match="stored bytes"):
        codec.decode(payload[:-1], bytearray(len(payload)))
    with pytest.raises(TypeError, match="read-only"):
        codec.decode(payload, payload)
