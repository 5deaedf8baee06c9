"""nvCOMP's batched zstd through its C API (``pykv/connector/nvcomp_batched.py``), against a
stand-in library over host memory (``fake_libnvcomp``): a step's frames go as one table and
decode bit-exact; a frame that decodes to another length than its plane, or fails, sets the
step's bad flag; the start check keeps the ``batched`` mode ahead of the Python API's and,
because it refuses lying frames, even where no checksum is verified before decoding; a library
of another major version, or one wanting aligned frames, is not used."""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import pytest
import zstandard

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

import fake_libnvcomp  # noqa: E402
from test_device_zstd import (CODEC, RAW, _fake_nvcomp, _install_fake, decoder, hostile, kv_tensors,  # noqa: E402
                              load, payload_of, tensors)  # noqa: F401  (fixture)

from pykv.codec.base import CodecError  # noqa: E402
from pykv.connector.nvcomp_batched import BatchedZstd, NvcompUnavailable, load_library  # noqa: E402
from pykv.connector.zstd_frames import NvcompFrames, lying_frame  # noqa: E402
from pykv.failures import Step  # noqa: E402


def frames_of(planes: list[bytes]) -> tuple[torch.Tensor, np.ndarray]:
    coded = [zstandard.ZstdCompressor(level=1, write_content_size=True).compress(p) for p in planes]
    spans, at = [], 0
    for frame in coded:
        spans.append((at, len(frame)))
        at += len(frame)
    return torch.frombuffer(bytearray(b"".join(coded)), dtype=torch.uint8), np.array(spans, dtype=np.int64)


def test_a_batch_decodes_bit_exact_in_one_call(monkeypatch):
    calls = []
    batched = BatchedZstd(torch.device("cpu"), fake_libnvcomp.fake_library(calls=calls))
    planes = [bytes((np.arange(n) % 13).astype(np.uint8)) for n in (5000, 1, 70000, 4096)]
    source, frames = frames_of(planes)
    target = torch.zeros(sum(len(p) for p in planes) + 10, dtype=torch.uint8)
    outputs = np.array([(10 + sum(len(p) for p in planes[:i]), len(p)) for i, p in enumerate(planes)], dtype=np.int64)
    bad, _ = batched.decode(source, frames, target, outputs)
    assert calls == [4] and not bool(bad)
    assert bytes(target[10:].numpy()) == b"".join(planes) and not target[:10].any()


@pytest.mark.parametrize("declared,holding", [(4096, 4000), (4096, 5000)])
def test_a_frame_of_another_length_than_its_plane_sets_the_bad_flag(declared, holding):
    batched = BatchedZstd(torch.device("cpu"), fake_libnvcomp.fake_library())
    source = torch.frombuffer(bytearray(lying_frame(declared, holding)), dtype=torch.uint8)
    target = torch.zeros(declared + 4096, dtype=torch.uint8)
    bad, _ = batched.decode(source, np.array([[0, source.numel()]]), target, np.array([[0, declared]]))
    assert bool(bad) and not target[declared:].any()


def test_a_decoder_reporting_a_lying_frames_length_is_still_caught_by_its_size_check():
    """A library that decodes a well-formed frame of fewer bytes than its plane without an error
    reports the shorter length: the step's flag compares it with the plane's."""
    batched = BatchedZstd(torch.device("cpu"), fake_libnvcomp.fake_library())
    plane = bytes(3000)
    source, frames = frames_of([plane])
    bad, _ = batched.decode(source, frames, torch.zeros(4096, dtype=torch.uint8), np.array([[0, 4096]]))
    assert bool(bad)


@pytest.mark.parametrize("frames,outputs", [([[0, 10**9]], [[0, 16]]), ([[-1, 4]], [[0, 16]]),
                                            ([[0, 4]], [[10, 4096]]), ([[0, 4]], [[-5, 4]])])
def test_spans_outside_the_steps_buffers_are_refused_before_any_call(frames, outputs):
    calls = []
    batched = BatchedZstd(torch.device("cpu"), fake_libnvcomp.fake_library(calls=calls))
    with pytest.raises(CodecError, match="outside"):
        batched.decode(torch.zeros(64, dtype=torch.uint8), np.array(frames), torch.zeros(4096, dtype=torch.uint8),
                       np.array(outputs))
    assert calls == []


def test_a_failing_call_is_a_codec_error():
    library = fake_libnvcomp.fake_library()
    library.nvcompBatchedZstdDecompressAsync = lambda *args: 9
    batched = BatchedZstd(torch.device("cpu"), library)
    source, frames = frames_of([bytes(100)])
    with pytest.raises(CodecError, match="status 9"):
        batched.decode(source, frames, torch.zeros(100, dtype=torch.uint8), np.array([[0, 100]]))


@pytest.mark.parametrize("kwargs,match", [({"version": 5000}, "version 5000"), ({"alignments": (8, 1, 8)}, "aligned"),
                                          ({"alignments": (1, 4, 8)}, "aligned")])
def test_another_major_version_or_aligned_frames_are_not_used(monkeypatch, kwargs, match):
    library = fake_libnvcomp.fake_library(**kwargs)
    fake_libnvcomp.install(monkeypatch, library)
    with pytest.raises(NvcompUnavailable, match=match):
        BatchedZstd(torch.device("cpu"))


def test_without_the_library_wheel_the_c_api_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.libnvcomp", None)
    with pytest.raises(NvcompUnavailable, match="nvidia-libnvcomp"):
        load_library()


def test_the_start_check_keeps_the_batched_mode_even_unchecked_and_loads_bit_exact(tensors, monkeypatch):
    """The Python API's modes decode lying frames without an error (``lenient``), the C API's
    size check refuses them: ``batched`` is kept, not lax, with ``verify=header`` too."""
    _install_fake(monkeypatch, _fake_nvcomp(into=True, sized=True, lenient="both"))
    calls = []
    fake_libnvcomp.install(monkeypatch, fake_libnvcomp.fake_library(calls=calls))
    frames = NvcompFrames(torch.device("cpu"), None)
    device = decoder(kv_tensors(1), frames, checked=False)
    device.self_test()
    assert frames.mode == "batched" and not device.lax_frames and not device.overrunning
    payload = payload_of(tensors, [3, 4])
    ok, failure, _ = load(device, CODEC.encode(payload), [5, 6])
    assert ok and failure is None and payload_of(device.copier.tensors, [5, 6]) == payload
    assert calls[-1] == sum(1 for _, size, spans in CODEC.plane_spans(CODEC.encode(payload), RAW)
                            for _, length in spans if length < size // 2)
    device.close()


@pytest.mark.parametrize("case", ["table-short", "table-zero", "table-over-plane", "trailing-byte",
                                  "frame-declares-other-size", "frame-short-content", "frame-corrupt"])
def test_a_hostile_block_through_the_batched_mode_is_a_check_failure(tensors, monkeypatch, case):
    """Tables and headers are refused on the host before any device work (the KV untouched);
    frames whose body lies or is corrupt set the step's flag (the load fails: recomputed)."""
    _install_fake(monkeypatch, _fake_nvcomp(into=True, sized=True))
    fake_libnvcomp.install(monkeypatch, fake_libnvcomp.fake_library())
    frames = NvcompFrames(torch.device("cpu"), None)
    device = decoder(kv_tensors(2), frames)
    device.self_test()
    assert frames.mode == "batched"
    before = [t.clone() for t in device.copier.tensors]
    stored = hostile(case, CODEC.encode(payload_of(kv_tensors(6), [0, 1])))[0]
    ok, failure, _ = load(device, stored, [9, 10])
    assert not ok and failure.step is Step.CHECK, failure
    if not case.startswith("frame-short") and case != "frame-corrupt":  # refused on the host, before device work
        assert all(torch.equal(a, b) for a, b in zip(device.copier.tensors, before))
    device.close()


@pytest.mark.parametrize("overrun,checked,authenticated,kept", [
    (False, False, False, False),  # lax and nothing checks the bytes: the next (strict) mode
    (False, True, False, True),  # lax, the checksum guards
    (True, True, False, False),  # writes past a plane: only with a MAC
    (True, True, True, True)])
def test_a_lax_library_is_judged_as_the_python_modes_are(monkeypatch, overrun, checked, authenticated, kept):
    _install_fake(monkeypatch, _fake_nvcomp(into=True, sized=True))
    fake_libnvcomp.install(monkeypatch, fake_libnvcomp.fake_library(lenient=True, overrun=overrun))
    frames = NvcompFrames(torch.device("cpu"), None)
    device = decoder(kv_tensors(3), frames, checked=checked, authenticated=authenticated)
    device.self_test()
    assert frames.mode == ("batched" if kept else "sized")
    assert device.lax_frames == kept and device.overrunning == (kept and overrun)
    device.close()


def test_step_tables_come_from_the_frames_offsets(monkeypatch):
    """The table's addresses are the buffers' own plus each span's offset (read back by the
    stand-in through raw pointers: a wrong address decodes other bytes)."""
    batched = BatchedZstd(torch.device("cpu"), fake_libnvcomp.fake_library())
    planes = [bytes([i]) * 3000 for i in range(1, 6)]
    source, frames = frames_of(planes)
    padded = torch.zeros(source.numel() + 7, dtype=torch.uint8)
    padded[7:] = source
    target = torch.zeros(5 * 3000, dtype=torch.uint8)
    order = [4, 2, 0, 3, 1]
    outputs = np.array([(3000 * slot, 3000) for slot in order], dtype=np.int64)
    bad, _ = batched.decode(padded, frames + np.array([7, 0]), target, outputs)
    assert not bool(bad)
    for plane, slot in zip(planes, order):
        assert bytes(target[3000 * slot:3000 * (slot + 1)].numpy()) == plane
    assert ctypes.sizeof(ctypes.c_size_t) == 8


def test_the_start_check_takes_the_largest_steps_scratch_and_refuses_a_gpu_without_room(tensors, monkeypatch):
    """The batched mode's tables and nvCOMP's scratch for the largest step are taken at the start
    check; where they do not fit, the mode is refused there (one line), not at every step."""
    _install_fake(monkeypatch, _fake_nvcomp(into=True, sized=True))
    library = fake_libnvcomp.fake_library()
    asked = []

    def temp_size(count, largest, opts, ref, total, stream):
        asked.append((count, largest, total))
        ref._obj.value = 1 << 62 if count > 4 else 64
        return 0

    library.nvcompBatchedZstdDecompressGetTempSize = temp_size
    fake_libnvcomp.install(monkeypatch, library)
    frames = NvcompFrames(torch.device("cpu"), None)
    device = decoder(kv_tensors(4), frames, step_blocks=3, authenticated=True)
    device.self_test()
    chunks = -(-RAW // CODEC.chunk)
    assert (3 * chunks * 2, CODEC.chunk // 2, 3 * RAW) in asked
    assert frames.mode == "sized"  # batched refused: its scratch for a step does not fit
    device.close()
