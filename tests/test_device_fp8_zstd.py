"""``DeviceFp8Zstd`` (pykv/connector/device_fp8_zstd.py) on CPU KV tensors with the host frame
decoder (and a fake nvCOMP) standing in for the GPU's: a store's fp8 bytes, once the codec
threads code them (``CodecStage.recode``), are exactly ``Fp8ZstdCodec.encode`` of the block's
payload; a load writes fp8's round trip of it into exactly the block's KV rows and keeps the
slot; what the CPU decoder refuses is a ``Step.CHECK`` failure that touches no KV;
``device_codec_for`` picks the frame decoder as ``codec_decode`` says.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from test_cuda_copier_threads import fake_cuda  # noqa: E402,F401  (fixture)
import device_rig  # noqa: E402
from device_rig import Ends  # noqa: E402
from test_device_zstd import _fake_nvcomp, _install_fake, config  # noqa: E402

from pykv.codec.fp8 import Fp8Codec  # noqa: E402
from pykv.codec.fp8_zstd import Fp8ZstdCodec  # noqa: E402
from pykv.codec.stage import CodecStage  # noqa: E402
from pykv.connector.codecs import device_codec_for  # noqa: E402
from pykv.connector.copier import CopyTask, TorchCopier  # noqa: E402
from pykv.connector.device_codec import CodedLoad  # noqa: E402
from pykv.connector.device_fp8_zstd import DeviceFp8HostZstd, DeviceFp8Zstd  # noqa: E402
from pykv.connector.layout import BlockLayout, RefPage  # noqa: E402
from pykv.connector.zstd_frames import HostFrames, NvcompFrames, lying_frame  # noqa: E402
from pykv.errors import InputError  # noqa: E402
from pykv.failures import Step  # noqa: E402

BPC = 2
NUM_BLOCKS = 16
PAGE = 8192
LAYOUT = BlockLayout(BPC, 64, ((RefPage(0, PAGE), RefPage(1, PAGE)),))
RAW = 2 * BPC * PAGE
CODEC = Fp8ZstdCodec(chunk=4096)  # several frames per block, the last chunk shorter
FP8 = Fp8Codec()


def kv_tensors(seed: int = 0) -> list[torch.Tensor]:
    return device_rig.kv_tensors(NUM_BLOCKS, PAGE, seed=seed)


def payload_of(tensors, ids) -> bytes:
    return device_rig.gathered(LAYOUT, RAW, tensors, ids)


def round_trip_into(tensors, stored: bytes, ids) -> list[torch.Tensor]:
    """``tensors`` as they should be after loading ``stored`` into blocks ``ids``: the CPU codec's
    round trip copied in by the plain copier."""
    expected = [t.clone() for t in tensors]
    decoded = torch.frombuffer(bytearray(CODEC.decode_bytes(stored, RAW)), dtype=torch.int8)
    TorchCopier(expected, LAYOUT).from_slots([CopyTask(decoded, 0, np.asarray(ids), 0)], lambda t, ok: None)
    return expected


def device(tensors, frames=None, **kwargs) -> DeviceFp8Zstd:
    return DeviceFp8Zstd(CODEC, TorchCopier(tensors, LAYOUT), [RAW], frames or HostFrames(CODEC.frames), **kwargs)


def load(dev, stored: bytes, ids, raw=RAW, params=CODEC.params):
    return device_rig.coded_load(dev, stored, ids, raw, params)


@pytest.fixture
def tensors():
    return kv_tensors()


def test_a_store_then_the_zstd_layer_leave_the_codecs_bytes_in_the_slot(tensors):
    slot = torch.zeros(RAW, dtype=torch.int8)
    ends = Ends()
    device(tensors).store([CopyTask(slot, 0, np.asarray([5, 9]), 0)], ends)
    [(_, ok, inner)] = ends.wait(1)
    assert ok and inner == FP8.stored_length(RAW)
    stage = CodecStage(CODEC.frames, RAW, threads=1)
    coded, done = [], threading.Event()
    stage.recode(memoryview(slot.numpy()).cast("B"), inner, lambda stored: (coded.append(stored), done.set()))
    assert done.wait(10)
    stage.close()
    expected = CODEC.encode(payload_of(tensors, [5, 9]))
    assert coded == [len(expected)] and len(expected) < inner
    assert slot.numpy().tobytes()[:len(expected)] == expected


def test_recode_refuses_what_would_not_fit_the_slot():
    stage = CodecStage(CODEC.frames, 4096, threads=1)
    got, done = [], threading.Event()
    stage.recode(memoryview(bytearray(4096)), 4097, lambda stored: (got.append(stored), done.set()))
    assert done.wait(10) and got == [None]
    stage.close()


def test_a_load_writes_fp8s_round_trip_into_the_blocks_rows_only_and_keeps_the_slot(tensors):
    stored = CODEC.encode(payload_of(kv_tensors(1), [2, 3]))
    expected = round_trip_into(tensors, stored, [7, 12])
    before = [t.clone() for t in tensors]
    ok, failure, slot = load(device(tensors), stored, [7, 12])
    assert ok and failure is None
    assert slot.numpy().tobytes() == stored
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected))
    assert [i for i in range(NUM_BLOCKS) if not torch.equal(tensors[0][i], before[0][i])] == [7, 12]


def _table(stored: bytes, index: int, value: int) -> bytes:
    out = bytearray(stored)
    out[4 * index:4 * index + 4] = value.to_bytes(4, "little")
    return bytes(out)


def hostile(case: str, stored: bytes) -> tuple[bytes, int, str]:
    raw, params = RAW, CODEC.params
    chunks = -(-CODEC.inner_length(RAW) // 4096)
    first = 4 * chunks  # the first chunk's frame follows the table
    length = int.from_bytes(stored[:4], "little") if stored else 0
    if case == "table-zero":
        stored = _table(stored, 1, 0)
    elif case == "trailing-byte":
        stored += b"\0"
    elif case == "frame-corrupt":
        out = bytearray(stored)
        out[first + length - 3:first + length] = b"\xff\xff\xff"
        stored = bytes(out)
    elif case == "frame-short-content":  # declares the chunk's 4,096 bytes, holds 3,000
        frame = lying_frame(4096, 3000)
        stored = _table(stored[:first] + frame + stored[first + length:], 0, len(frame))
    elif case == "bad-scale":  # the zstd layer is sound, the fp8 bytes inside are not
        inner = bytearray(FP8.encode(payload_of(kv_tensors(2), [0, 1])))
        inner[0] = 0xFF
        stored = CODEC.frames.encode(bytes(inner))
    elif case == "fp8-params":
        params = FP8.params
    elif case == "raw-not-groups":
        raw = RAW - 64
    elif case == "raw-too-large":
        raw = 2 * RAW
    return stored, raw, params


@pytest.mark.parametrize("case", ["table-zero", "trailing-byte", "frame-corrupt", "frame-short-content",
                                  "fp8-params", "raw-not-groups", "raw-too-large"])
def test_hostile_blocks_are_check_failures_and_touch_no_kv(tensors, case):
    stored, raw, params = hostile(case, CODEC.encode(payload_of(kv_tensors(3), [0, 1])))
    if case in ("table-zero", "trailing-byte", "frame-corrupt", "frame-short-content"):
        with pytest.raises(Exception):
            CODEC.decode_bytes(stored, raw)  # the CPU decoder refuses it too
    before = [t.clone() for t in tensors]
    ok, failure, _ = load(device(tensors), stored, [3, 4], raw=raw, params=params)
    assert not ok and failure.step is Step.CHECK, failure
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def test_fp8_bytes_the_encoder_never_writes_fail_the_load(tensors):
    """Found on the device after decoding (the flag is read when the step is done): the block
    fails, and the engine recomputes what it wrote (``kv_load_failure_policy=recompute``)."""
    stored = hostile("bad-scale", b"")[0]
    with pytest.raises(Exception):
        CODEC.decode_bytes(stored, RAW)
    ok, failure, _ = load(device(tensors), stored, [3, 4])
    assert not ok and failure.step is Step.CHECK


def test_a_step_of_several_loads_fails_only_the_hostile_block(tensors):
    blocks = {i: CODEC.encode(payload_of(kv_tensors(10 + i), [0, 1])) for i in range(4)}
    blocks[2] = hostile("bad-scale", blocks[2])[0]
    dev = device(tensors, step_blocks=4)
    expected = tensors
    for i in (0, 1, 3):
        expected = round_trip_into(expected, blocks[i], [2 * i, 2 * i + 1])
    ends = Ends()
    dev.load([CodedLoad(CopyTask(torch.frombuffer(bytearray(blocks[i]), dtype=torch.int8), 0,
                                 np.asarray([2 * i, 2 * i + 1]), 0, token=i), RAW, CODEC.params) for i in range(4)], ends)
    calls = ends.wait(4)
    assert {task.token: ok for task, ok, _ in calls} == {0: True, 1: True, 2: False, 3: True}
    assert all(torch.equal(tensors[k][b], expected[k][b]) for k in range(2) for b in (0, 1, 2, 3, 6, 7))


def test_the_stream_path_ends_every_load_once(tensors, fake_cuda):
    stored = CODEC.encode(payload_of(kv_tensors(5), [0, 1]))
    dev = device(tensors, streams=True)
    ends = Ends()
    for i in range(30):
        bad = hostile("frame-corrupt", stored)[0] if i % 10 == 9 else stored
        dev.load([CodedLoad(CopyTask(torch.frombuffer(bytearray(bad), dtype=torch.int8), 0,
                                     np.asarray([2 * (i % 7), 2 * (i % 7) + 1]), 0, token=i), RAW, CODEC.params)], ends)
    calls = ends.wait(30)
    dev.close(timeout=5)
    assert sorted(task.token for task, _, _ in calls) == list(range(30))
    assert {task.token for task, ok, _ in calls if not ok} == {9, 19, 29}


@pytest.mark.parametrize("mode", NvcompFrames.modes)
def test_loads_through_nvcomp_are_fp8s_round_trip_in_every_mode(tensors, monkeypatch, mode):
    import fake_libnvcomp
    _install_fake(monkeypatch, _fake_nvcomp(into=True, sized=True))
    fake_libnvcomp.install(monkeypatch, fake_libnvcomp.fake_library())
    frames = NvcompFrames(torch.device("cpu"), None)
    frames.mode = mode
    stored = CODEC.encode(payload_of(kv_tensors(6), [0, 1]))
    expected = round_trip_into(tensors, stored, [4, 5])
    ok, failure, _ = load(device(tensors, frames), stored, [4, 5])
    assert ok and failure is None
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected))


def test_device_codec_for_decodes_fp8_zstd_frames_on_the_codec_threads_without_a_gpu(tensors):
    copier = TorchCopier(tensors, LAYOUT)
    codec = Fp8ZstdCodec()
    for keys in ({}, {"codec_decode": "cpu"}):
        dev = device_codec_for(codec, config(codec="fp8-zstd", **keys), copier, [RAW])
        assert isinstance(dev, DeviceFp8HostZstd) and dev.host_layer and dev.host_frames
        assert dev.params == codec.params and dev.layer.params == codec.frames.params
        dev.close()
    with pytest.raises(InputError, match="codec_decode: gpu") as refused:
        device_codec_for(codec, config(codec="fp8-zstd", codec_decode="gpu"), copier, [RAW])
    assert "\n" not in str(refused.value)


def test_a_layout_that_is_not_whole_groups_is_refused_at_start(tensors):
    with pytest.raises(InputError, match="whole groups"):
        DeviceFp8Zstd(CODEC, TorchCopier(tensors, LAYOUT), [RAW - 64], HostFrames(CODEC.frames))


# -- without nvCOMP: the codec threads decode the zstd layer, fp8's device step the rest ----------
def host_zstd(tensors) -> DeviceFp8HostZstd:
    return DeviceFp8HostZstd(CODEC, TorchCopier(tensors, LAYOUT), [RAW])


def layered_load(dev, stage, stored: bytes, ids, raw=RAW, params=CODEC.params):
    """The worker's steps for a ``host_frames`` decoder: the layer on a codec thread into a scratch
    buffer, then those fp8 bytes through the device decoder; (ok, failure, the slot's bytes after)."""
    slot = bytearray(stored)
    inner = dev.unlayered(params, raw)
    if inner is None:
        return False, "refused", bytes(slot)
    got, done = [], threading.Event()
    stage.decode(memoryview(slot), inner, stage.params, lambda buffer, failure: (got.append((buffer, failure)),
                                                                                  done.set()))
    assert done.wait(10)
    [(buffer, failure)] = got
    if buffer is None:
        return False, failure, bytes(slot)
    scratch = torch.frombuffer(stage.view(buffer), dtype=torch.int8)[:inner]
    ends = Ends()
    dev.load([CodedLoad(CopyTask(scratch, 0, np.asarray(ids), 0), raw, params)], ends)
    [(_, ok, failure)] = ends.wait(1)
    stage.release(buffer)
    return ok, failure, bytes(slot)


@pytest.fixture
def layered(tensors):
    dev, stage = host_zstd(tensors), CodecStage(CODEC.frames, RAW, threads=2)
    yield dev, stage
    dev.close()
    stage.close()


def test_host_layer_loads_are_fp8s_round_trip_and_keep_the_slot(tensors, layered):
    dev, stage = layered
    stored = CODEC.encode(payload_of(kv_tensors(1), [2, 3]))
    expected = round_trip_into(tensors, stored, [7, 12])
    before = [t.clone() for t in tensors]
    ok, failure, slot = layered_load(dev, stage, stored, [7, 12])
    assert ok and failure is None and slot == stored  # a DRAM-tier slot serves the next hit as it is
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected))
    assert [i for i in range(NUM_BLOCKS) if not torch.equal(tensors[0][i], before[0][i])] == [7, 12]


def test_host_layer_stores_are_the_cpu_codecs_bytes(tensors, layered):
    dev, stage = layered
    slot = torch.zeros(RAW, dtype=torch.int8)
    ends = Ends()
    dev.store([CopyTask(slot, 0, np.asarray([5, 9]), 0)], ends)
    [(_, ok, inner)] = ends.wait(1)
    coded, done = [], threading.Event()
    stage.recode(memoryview(slot.numpy()).cast("B"), inner, lambda stored: (coded.append(stored), done.set()))
    assert ok and done.wait(10)
    expected = CODEC.encode(payload_of(tensors, [5, 9]))
    assert coded == [len(expected)] and slot.numpy().tobytes()[:len(expected)] == expected


@pytest.mark.parametrize("raw, params", [(RAW, FP8.params), (RAW, "planes-zstd:v1"), (RAW + 128, CODEC.params),
                                         (RAW - 2, CODEC.params), (0, CODEC.params), (-RAW, CODEC.params)])
def test_host_layer_refuses_blocks_of_other_codecs_or_lengths(tensors, layered, raw, params):
    dev, _ = layered
    assert dev.unlayered(params, raw) is None


@pytest.mark.parametrize("case", ["table-zero", "trailing-byte", "frame-corrupt", "frame-short-content",
                                  "bad-scale", "fp8-params", "raw-not-groups", "raw-too-large", "empty"])
def test_host_layer_hostile_blocks_fail_and_touch_no_kv(tensors, layered, case):
    dev, stage = layered
    stored, raw, params = hostile(case, CODEC.encode(payload_of(kv_tensors(3), [0, 1])))
    if case == "empty":
        stored = b""
    before = [t.clone() for t in tensors]
    ok, failure, slot = layered_load(dev, stage, stored, [3, 4], raw=raw, params=params)
    assert not ok and slot == stored
    assert failure == "refused" or (failure.step is Step.CHECK and "\n" not in failure.detail), failure
    if case != "bad-scale":  # found on the device after dequantizing: the engine recomputes those rows
        assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def test_host_layer_scratch_of_the_wrong_length_is_refused_on_the_device(tensors, layered):
    dev, _ = layered
    short = torch.zeros(CODEC.inner_length(RAW) - 1, dtype=torch.int8)
    ends = Ends()
    dev.load([CodedLoad(CopyTask(short, 0, np.asarray([1]), 0), RAW, CODEC.params)], ends)
    [(_, ok, failure)] = ends.wait(1)
    assert not ok and failure.step is Step.CHECK
