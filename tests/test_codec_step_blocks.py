"""``codec_step_blocks``: parsed as ``auto`` or 1..16 (anything else one line naming the key), and
passed to every device codec ``device_codec_for`` builds (``fp8``, ``fp8-zstd`` on the codec threads,
``planes-zstd`` and ``fp8-zstd`` through nvCOMP), whose steps then take that many loads at most
and whose scratch holds that many blocks."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

import device_rig  # noqa: E402

from pykv.codec import codec_for  # noqa: E402
from pykv.config import PykvConfig  # noqa: E402
from pykv.config_values import MAX_STEP_BLOCKS  # noqa: E402
from pykv.connector.codecs import device_codec_for, where_decoded  # noqa: E402
from pykv.connector.copier import CopyTask, TorchCopier  # noqa: E402
from pykv.connector.device_codec import STEP_BYTES, DeviceFp8, _Work  # noqa: E402
from pykv.connector.layout import BlockLayout, RefPage  # noqa: E402
from pykv.errors import InputError  # noqa: E402

BPC = 2
PAGE = 256
LAYOUT = BlockLayout(BPC, 64, ((RefPage(0, PAGE), RefPage(1, PAGE)),))
RAW = 2 * BPC * PAGE


def config(**keys) -> PykvConfig:
    return PykvConfig.from_extra_config({"root": "/r", **keys})


def copier() -> TorchCopier:
    return TorchCopier(device_rig.kv_tensors(16, PAGE, (1, 2), 0), LAYOUT)


def test_auto_by_default_and_written_back_as_auto():
    assert config().codec_step_blocks is None
    assert config().to_extra_config()["codec_step_blocks"] == "auto"
    assert config(codec_step_blocks=" AUTO ").codec_step_blocks is None
    assert config(codec_step_blocks="8").to_extra_config()["codec_step_blocks"] == 8
    assert [config(codec_step_blocks=v).codec_step_blocks for v in (1, "16", " 3 ")] == [1, 16, 3]


@pytest.mark.parametrize("value", [0, -1, 17, "17", "0x8", "8.0", 2.5, True, "", "eight", "１２", [8],
                                   "9" * 400])
def test_anything_else_is_one_line_naming_the_key(value):
    with pytest.raises(InputError) as refused:
        config(codec_step_blocks=value)
    text = str(refused.value)
    assert "codec_step_blocks" in text and "1 to 16" in text and "\n" not in text and len(text) < 200


def test_fp8_steps_take_the_configured_loads_and_scratch():
    for value, expected in (("auto", MAX_STEP_BLOCKS), ("1", 1), ("5", 5)):  # small blocks: auto is the cap
        device = device_codec_for(codec_for("fp8", dtype="bfloat16"), config(codec="fp8", codec_step_blocks=value),
                                  copier(), [RAW])
        try:
            assert isinstance(device, DeviceFp8) and device.step_blocks == expected
            assert device.payload.numel() == expected * RAW
            assert f"({expected} blocks per device step)" in where_decoded(codec_for("fp8", dtype="bfloat16"), device)
        finally:
            device.close()


def test_a_step_takes_no_more_queued_loads_than_configured():
    device = device_codec_for(codec_for("fp8", dtype="bfloat16"), config(codec="fp8", codec_step_blocks="2"),
                              copier(), [RAW])
    try:
        device.close()  # the step thread gone: _take is driven here
        device._closed = False
        works = [_Work(False, types.SimpleNamespace(raw_length=RAW),
                       CopyTask(torch.zeros(8, dtype=torch.int8), 0, np.asarray([i]), 0, token=i), None)
                 for i in range(5)]
        for work in works:
            device._queued.put(work)
        device._queued.put(None)
        assert [len(device._take()) for _ in range(3)] == [2, 2, 1]
    finally:
        device.close()


def test_the_configured_value_overrides_the_scratch_bound_both_ways():
    big = STEP_BYTES // 3 // 128 * 128  # auto: 3 blocks of this size
    assert DeviceFp8(codec_for("fp8", dtype="bfloat16"), copier(), [big]).step_blocks == 3
    device = DeviceFp8(codec_for("fp8", dtype="bfloat16"), copier(), [RAW], step_blocks=2)
    assert device.step_blocks == 2 and device.payload.numel() == 2 * RAW
    device.close()


def test_fp8_zstd_on_the_codec_threads_gets_it():
    from pykv.codec.fp8_zstd import Fp8ZstdCodec
    device = device_codec_for(Fp8ZstdCodec(), config(codec="fp8-zstd", codec_step_blocks=4), copier(), [RAW])
    try:
        assert device.step_blocks == 4
    finally:
        device.close()


@pytest.mark.parametrize("codec_name,module_name,class_name", [
    ("planes-zstd", "pykv.connector.device_zstd", "DevicePlanesZstd"),
    ("fp8-zstd", "pykv.connector.device_fp8_zstd", "DeviceFp8Zstd")])
def test_the_nvcomp_decoders_get_it(monkeypatch, codec_name, module_name, class_name):
    import importlib
    module = importlib.import_module(module_name)
    made = []

    class Recording:
        def __init__(self, *args, step_blocks=None, **kwargs):
            made.append(step_blocks)

        def self_test(self):
            pass

    monkeypatch.setattr(module, class_name, Recording)
    gpu = types.SimpleNamespace(tensors=[types.SimpleNamespace(device=torch.device("cuda", 0))])
    codec = codec_for(codec_name, dtype="bfloat16") if codec_name == "fp8-zstd" else codec_for(codec_name)
    for value, expected in (("auto", None), ("7", 7)):
        device_codec_for(codec, config(codec=codec_name, codec_step_blocks=value, auth_key_file="/k"), gpu, [RAW])
        assert made[-1] == expected
