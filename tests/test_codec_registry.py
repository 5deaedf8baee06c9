"""``pykv/codec/registry.py`` and ``identity.py``: codecs chosen by name, unknown names refused
in one line, ``none`` stores the payload as it is."""

from __future__ import annotations

import pytest

from pykv.codec import CODEC_NAMES, CodecError, UnknownCodecError, codec_for
from pykv.errors import InputError


def test_every_name_gives_its_codec_with_distinct_params():
    codecs = [codec_for(name) for name in CODEC_NAMES]
    assert [c.name for c in codecs] == list(CODEC_NAMES)
    assert len({c.params for c in codecs}) == len(codecs)
    assert all(c.params.startswith(c.name) for c in codecs)


def test_fp8_defaults_to_bfloat16_and_takes_its_dtype_and_group():
    pytest.importorskip("torch")
    assert codec_for("fp8").params == "fp8:v2,e4m3,group=64,scale=e8m0,dtype=bfloat16"
    assert codec_for("fp8", group=None).params == codec_for("fp8").params
    codec = codec_for("fp8", dtype="float16", group=128)
    assert codec.params == "fp8:v2,e4m3,group=128,scale=e8m0,dtype=float16"
    assert codec.stored_length(2 * 256) == 256 + 2  # one code per value, one scale byte per group


@pytest.mark.parametrize("group", [0, -64, 4097])
def test_an_fp8_group_it_cannot_use_is_refused_in_one_line(group):
    pytest.importorskip("torch")
    with pytest.raises(UnknownCodecError) as refused:
        codec_for("fp8", group=group)  # 0 is not "the default": it is refused like any other
    message = str(refused.value)
    assert "\n" not in message and "fp8" in message and f"not {group}" in message
    assert isinstance(refused.value, InputError)


def test_unknown_names_are_refused_in_one_line():
    with pytest.raises(UnknownCodecError) as refused:
        codec_for("gzip")
    message = str(refused.value)
    assert "\n" not in message and "'gzip'" in message and "none, planes-zstd, fp8" in message
    assert isinstance(refused.value, InputError)


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn", "int8"])
def test_a_dtype_fp8_does_not_encode_is_refused_in_one_line(dtype):
    pytest.importorskip("torch")
    with pytest.raises(UnknownCodecError) as refused:
        codec_for("fp8", dtype=dtype)
    message = str(refused.value)
    assert "\n" not in message and "fp8" in message and dtype in message
    assert isinstance(refused.value, InputError)


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
