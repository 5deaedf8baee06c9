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


def test_codec_chunk_sets_the_zstd_codecs_chunk_and_their_namespace():
    """``codec_chunk`` is one of the zstd codecs' parameters (so of the namespace); the default is
    each codec's own; ``none`` and ``fp8`` ignore it; the format reads blocks of any chunk the key
    allows back to the same codec, and of none it refuses."""
    from pykv.config import PykvConfig
    from pykv.connector.codecs import engine_codec
    from pykv.format_codec import codec_from_params

    assert codec_for("planes-zstd").params.endswith("chunk=1048576")
    assert codec_for("planes-zstd", chunk=65536).params.endswith("chunk=65536")
    assert codec_for("fp8-zstd", chunk=65536).params.endswith("chunk=65536")
    config = PykvConfig.from_extra_config({"root": "/tmp", "codec": "planes-zstd", "codec_chunk": "256KiB"})
    assert config.codec_chunk == 1 << 18 and engine_codec(config).params.endswith("chunk=262144")
    assert PykvConfig.from_extra_config({"root": "/tmp", "codec": "none", "codec_chunk": "64K"}).codec_chunk == 65536
    for chunk in (16 << 10, 1 << 18, 64 << 20):
        for name in ("planes-zstd", "fp8-zstd"):
            params = codec_for(name, chunk=chunk).params
            assert codec_from_params(params).params == params
    planes = codec_for("planes-zstd").params
    for chunk in ("4096", "12288", "16385", str(128 << 20), "-16384", "9" * 40, "0x4000", ""):
        assert codec_from_params(planes.replace("chunk=1048576", f"chunk={chunk}")) is None


@pytest.mark.parametrize("value", ["8K", "20000", "128M", "0", "-16K", "lots"])
def test_a_codec_chunk_outside_the_allowed_sizes_is_refused_in_one_line(value):
    from pykv.config import PykvConfig
    with pytest.raises(InputError) as refused:
        PykvConfig.from_extra_config({"root": "/tmp", "codec": "planes-zstd", "codec_chunk": value})
    assert "codec_chunk" in str(refused.value) and "\n" not in str(refused.value)
