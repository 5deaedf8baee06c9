"""``DevicePlanesZstd`` (pykv/connector/device_zstd.py) on CPU KV tensors with the host frame
decoder standing in for nvCOMP: a load writes exactly the block's payload into exactly its KV
rows (lossless) and never changes the slot; what the CPU decoder refuses (table, frame headers,
frames) is a ``Step.CHECK`` failure before any KV is written; a frame decoder's bad flag is one
too; the stream path ends each block once; ``device_codec_for`` picks the decoder as
``codec_decode`` says.
"""

from __future__ import annotations

import ctypes
import struct
import sys
import types

import numpy as np
import pytest
import zstandard

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from test_cuda_copier_threads import fake_cuda  # noqa: E402,F401  (fixture)
import device_rig  # noqa: E402
from device_rig import Ends  # noqa: E402

from pykv.codec.base import CodecError  # noqa: E402
from pykv.codec.lossless import PlanesZstdCodec  # noqa: E402
from pykv.config import PykvConfig  # noqa: E402
from pykv.connector.codecs import device_codec_for  # noqa: E402
from pykv.connector.copier import CopyTask, TorchCopier  # noqa: E402
from pykv.connector.device_codec import CodedLoad, DeviceFp8  # noqa: E402
from pykv.connector.device_zstd import DevicePlanesZstd  # noqa: E402
from pykv.connector.zstd_frames import HostFrames, NvcompFrames, lying_frame  # noqa: E402
from pykv.connector.layout import BlockLayout, RefPage  # noqa: E402
from pykv.codec import codec_for  # noqa: E402
from pykv.errors import InputError  # noqa: E402
from pykv.failures import Step  # noqa: E402

BPC = 2
NUM_BLOCKS = 16
PAGE = 4096
LAYOUT = BlockLayout(BPC, 64, ((RefPage(0, PAGE), RefPage(1, PAGE)),))
RAW = 2 * BPC * PAGE
CODEC = PlanesZstdCodec(chunk=3000)  # several chunks, the last one shorter


def kv_tensors(seed: int = 0) -> list[torch.Tensor]:
    return device_rig.kv_tensors(NUM_BLOCKS, PAGE, seed=seed)


def payload_of(tensors, ids) -> bytes:
    return device_rig.gathered(LAYOUT, RAW, tensors, ids)


def decoder(tensors, frames=None, **kwargs) -> DevicePlanesZstd:
    return DevicePlanesZstd(CODEC, TorchCopier(tensors, LAYOUT), RAW, frames or HostFrames(CODEC), **kwargs)


def load(device, stored: bytes, ids, raw=RAW, params=CODEC.params, skip=0):
    return device_rig.coded_load(device, stored, ids, raw, params, skip)


@pytest.fixture
def tensors():
    return kv_tensors()


def test_the_stored_block_has_frames_and_raw_planes():
    stored = CODEC.encode(payload_of(kv_tensors(1), [0, 1]))
    spans = CODEC.plane_spans(stored, RAW)
    kinds = {length == size // 2 for _, size, chunk in spans for _, length in chunk}
    assert kinds == {True, False} and len(spans) == 6  # raw planes and zstd frames, 5 whole chunks and a short one


def test_a_load_writes_the_payload_bit_exact_into_the_blocks_rows_only(tensors):
    source = kv_tensors(1)
    payload = payload_of(source, [2, 3])
    stored = CODEC.encode(payload)
    before = [t.clone() for t in tensors]
    ok, failure, slot = load(decoder(tensors), stored, [7, 12])
    assert ok and failure is None
    assert slot.numpy().tobytes() == stored
    assert payload_of(tensors, [7, 12]) == payload
    changed = [i for i in range(NUM_BLOCKS) if not torch.equal(tensors[0][i], before[0][i])]
    assert changed == [7, 12]


def test_a_load_after_a_prefix_hit_writes_only_the_uncovered_sub_block(tensors):
    source = kv_tensors(2)
    stored = CODEC.encode(payload_of(source, [0, 1]))
    ok, _, _ = load(decoder(tensors), stored, [4], skip=1)
    assert ok and torch.equal(tensors[0][4], source[0][1]) and torch.equal(tensors[1][4], source[1][1])


def _table_entry(stored: bytes, index: int, value: int) -> bytes:
    out = bytearray(stored)
    struct.pack_into("<I", out, 4 * index, value)
    return bytes(out)


def _first_frame(stored: bytes) -> tuple[int, int]:
    for _, size, chunk in CODEC.plane_spans(stored, RAW):
        for position, length in chunk:
            if length < size // 2:
                return position, length
    raise AssertionError("no frame")


def _with_frame(stored: bytes, frame: bytes) -> bytes:
    """``stored`` with its first zstd frame replaced by ``frame`` (its table entry updated)."""
    position, length = _first_frame(stored)
    entry = next(i for i, (p, _) in enumerate(span for _, _, spans in CODEC.plane_spans(stored, RAW)
                                              for span in spans) if p == position)
    return _table_entry(stored[:position] + frame + stored[position + length:], entry, len(frame))


def hostile(case: str, stored: bytes) -> tuple[bytes, int, str]:
    raw, params = RAW, CODEC.params
    position, length = _first_frame(stored)
    if case == "table-short":
        stored = _table_entry(stored, 0, 1)
    elif case == "table-zero":
        stored = _table_entry(stored, 1, 0)
    elif case == "table-over-plane":
        stored = _table_entry(stored, 0, 1501)
    elif case == "trailing-byte":
        stored = stored + b"\0"
    elif case == "frame-declares-other-size":  # a frame of 1,499 bytes where the plane has 1,500
        frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(1499))
        assert len(frame) <= length
        out = bytearray(stored)
        out[position:position + length] = frame + bytes(length - len(frame))
        stored = bytes(out)
    elif case == "frame-short-content":  # declares the plane's 1,500 bytes, holds 1,400
        stored = _with_frame(stored, lying_frame(1500, 1400))
    elif case == "frame-corrupt":
        out = bytearray(stored)
        out[position + length - 3:position + length] = b"\xff\xff\xff"
        stored = bytes(out)
    elif case == "other-codec":
        params = PlanesZstdCodec(chunk=1 << 20).params
    elif case == "raw-odd":
        raw = RAW - 1
    elif case == "raw-too-large":
        raw = 2 * RAW
    elif case == "raw-zero":
        raw = 0
    return stored, raw, params


@pytest.mark.parametrize("case", ["table-short", "table-zero", "table-over-plane", "trailing-byte",
                                  "frame-declares-other-size", "frame-short-content", "frame-corrupt",
                                  "other-codec", "raw-odd", "raw-too-large", "raw-zero"])
def test_what_the_cpu_decoder_refuses_is_a_check_failure(tensors, case):
    stored, raw, params = hostile(case, CODEC.encode(payload_of(kv_tensors(3), [0, 1])))
    if case not in ("other-codec", "raw-odd", "raw-too-large", "raw-zero"):
        with pytest.raises(Exception):
            CODEC.decode_bytes(stored, raw)  # the CPU decoder refuses it too
    before = [t.clone() for t in tensors]
    ok, failure, _ = load(decoder(tensors), stored, [3, 4], raw=raw, params=params)
    assert not ok and failure.step is Step.CHECK, failure
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


class FlaggingFrames(HostFrames):
    def decode(self, source, frames, target, outputs):
        super().decode(source, frames, target, outputs)
        return torch.ones((), dtype=torch.bool), None


def test_a_frame_decoders_bad_flag_fails_the_load(tensors):
    stored = CODEC.encode(payload_of(kv_tensors(4), [0, 1]))
    ok, failure, _ = load(decoder(tensors, FlaggingFrames(CODEC)), stored, [3, 4])
    assert not ok and failure.step is Step.CHECK


class WrongFrames(HostFrames):
    def decode(self, source, frames, target, outputs):
        for into, size in outputs.tolist():
            target[into:into + size].fill_(7)
        return torch.zeros((), dtype=torch.bool), None


def test_the_start_check_refuses_a_decoder_that_writes_wrong_bytes(tensors):
    decoder(tensors).self_test()  # the host decoder passes
    with pytest.raises(InputError, match="start check") as refused:
        decoder(tensors, WrongFrames(CODEC)).self_test()
    assert "\n" not in str(refused.value)


def test_the_stream_path_ends_every_load_once_bit_exact(tensors, fake_cuda):
    source = kv_tensors(5)
    stored = CODEC.encode(payload_of(source, [0, 1]))
    device = decoder(tensors, streams=True)
    ends = Ends()
    for i in range(70):
        bad = hostile("frame-corrupt", stored)[0] if i % 10 == 9 else stored
        slot = torch.frombuffer(bytearray(bad), dtype=torch.int8)
        device.load([CodedLoad(CopyTask(slot, 0, np.asarray([2 * (i % 7), 2 * (i % 7) + 1]), 0, token=i), RAW,
                               CODEC.params)], ends)
    calls = ends.wait(70)
    device.close(timeout=5)
    assert sorted(task.token for task, _, _ in calls) == list(range(70))
    assert {task.token for task, ok, _ in calls if not ok} == {i for i in range(70) if i % 10 == 9}
    assert payload_of(tensors, [2, 3]) == payload_of(source, [0, 1])
    assert not any(t.is_alive() for t in device._threads)
    stats = device.stats  # the refused loads are never issued: only the 63 good ones count
    assert stats["codec_loads"] == 63 and 1 <= stats["codec_load_steps"] == stats["codec_steps"] <= 63
    assert stats["codec_gpu_us"] == 500 * stats["codec_steps"]  # the fake events: 0.5 ms each
    assert stats["codec_frames_us"] > 0 and stats["codec_wall_us"] > 0


def config(**keys) -> PykvConfig:
    return PykvConfig.from_extra_config({"root": "/r", **keys})


def test_device_codec_for_follows_codec_decode_on_the_cpu_platform(tensors):
    copier = TorchCopier(tensors, LAYOUT)
    zstd = codec_for("planes-zstd")
    assert device_codec_for(zstd, config(codec="planes-zstd"), copier, [RAW]) is None  # auto: no GPU
    assert device_codec_for(zstd, config(codec="planes-zstd", codec_decode="cpu"), copier, [RAW]) is None
    with pytest.raises(InputError, match="codec_decode: gpu") as refused:
        device_codec_for(zstd, config(codec="planes-zstd", codec_decode="gpu"), copier, [RAW])
    assert "\n" not in str(refused.value)
    assert isinstance(device_codec_for(codec_for("fp8"), config(codec="fp8"), copier, [RAW]), DeviceFp8)
    assert device_codec_for(codec_for("none"), config(), copier, [RAW]) is None


def test_without_nvcomp_the_gpu_decoder_is_refused_in_one_line(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "nvidia.nvcomp", None)  # import fails as where it is not installed
    with pytest.raises(InputError, match="nvidia-nvcomp") as refused:
        NvcompFrames(torch.device("cuda", 0), None)
    assert "\n" not in str(refused.value)


def test_a_decoder_refused_at_construction_leaves_no_threads(tensors, monkeypatch):
    import sys
    import threading
    monkeypatch.setitem(sys.modules, "nvidia.nvcomp", None)
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(InputError, match="nvidia-nvcomp"):
        DevicePlanesZstd(CODEC, TorchCopier(tensors, LAYOUT), RAW)  # no frame decoder given: nvCOMP's
    left = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("pykv-")]
    for thread in left:
        thread.join(5)
    assert not [t for t in left if t.is_alive()]


def _fake_nvcomp(*, into: bool = False, lenient: str = "", sized: bool = False, interface: bool = True,
                 overrun: bool = False):
    """nvCOMP 6.0's Python surface as the H200 showed it (run 20): ``Codec.decode`` takes one
    ``Array`` or a batch from ``as_arrays``, and refuses a plain list of arrays (``TypeError``).
    ``as_arrays`` takes torch tensors and, with ``interface``, objects with a CUDA Array Interface
    (here over host memory: the tests run on the CPU); else those are a ``TypeError``.
    ``into``: it also takes ``out=`` (a batch of outputs, filled in place; nvCOMP 6's docstrings);
    otherwise ``out=`` is a ``TypeError``. ``sized``: it also takes a ``decompression_config`` built
    from sizes (``compression_config``; else those are missing, as in a build without them).
    ``lenient`` ("into", "both", "sized"): a frame holding fewer bytes than it declares decodes
    without an error there (its tail left as it was, or zeros in an array of the declared size;
    "sized": only with a config, as a decoder that never reads its status back would): what the
    start check must catch. ``overrun``: a lying frame writes 4 KiB past its output (as nvCOMP 6.0
    did on the H100 for a frame holding more bytes than it declares, run 23)."""

    class Batch(list):
        pass

    def inflate(frame: bytes, soft: bool) -> np.ndarray:
        try:
            return np.frombuffer(zstandard.ZstdDecompressor().decompress(frame), dtype=np.uint8)
        except zstandard.ZstdError:
            if not soft:
                raise RuntimeError("nvcomp: decompression failed") from None
            return np.zeros(max(zstandard.frame_content_size(frame), 0), dtype=np.uint8)

    class Codec:
        configs_built = 0

        def __init__(self, **kwargs) -> None:
            self.kwargs = kwargs

        def __getattr__(self, name):
            if sized and name == "compression_config":
                return lambda sizes: ("sizes", tuple(sizes))
            if sized and name == "decompression_config":
                def config(compression):
                    Codec.configs_built += 1
                    return ("config", compression)
                return config
            raise AttributeError(name)

        def decode(self, src, **kwargs):
            if not isinstance(src, Batch) or ("out" in kwargs and not into):
                raise TypeError("decode(): incompatible function arguments")
            config = kwargs.get("decompression_config")
            if config is not None and (not sized or config[1][1] != tuple(o.numel() for o in kwargs["out"])):
                raise TypeError("decode(): a config of other sizes")
            if "out" not in kwargs:
                return [inflate(bytes(frame.numpy()), lenient == "both") for frame in src]
            soft = lenient in ("into", "both") or (lenient == "sized" and config is not None)
            for frame, target in zip(src, kwargs["out"]):
                values = inflate(bytes(frame.numpy()), soft)
                if overrun and not values.any():  # a lying frame: 4 KiB past its output
                    ctypes.memset(target.data_ptr(), 7, target.numel() + 4096)
                    continue
                if values.size > target.numel():
                    raise ValueError("output buffer too small")
                if values.any():  # a soft failure writes nothing
                    target[:values.size].copy_(torch.from_numpy(values.copy()))
            return kwargs["out"]

    def as_tensor(item):
        if isinstance(item, torch.Tensor):
            return item
        face = getattr(item, "__cuda_array_interface__", None)
        if not interface or face is None:
            raise TypeError(f"as_arrays(): unsupported {type(item).__name__}")
        assert face["version"] == 3 and face["typestr"] == "|u1" and face["strides"] is None
        (length,), (address, readonly) = face["shape"], face["data"]
        assert not readonly
        return torch.frombuffer((ctypes.c_uint8 * length).from_address(address), dtype=torch.uint8)

    return types.SimpleNamespace(BitstreamKind=types.SimpleNamespace(RAW="raw"), Codec=Codec,
                                 as_arrays=lambda items, cuda_stream=0: Batch(as_tensor(i) for i in items))


def _install_fake(monkeypatch, fake) -> None:
    package = types.ModuleType("nvidia")
    package.nvcomp = fake
    monkeypatch.setitem(sys.modules, "nvidia", package)
    monkeypatch.setitem(sys.modules, "nvidia.nvcomp", fake)


@pytest.mark.parametrize("into", [False, True])
def test_the_nvcomp_frame_decoder_passes_one_batch_and_loads_bit_exact(tensors, monkeypatch, into):
    """Into the planes (``out=``) where nvCOMP takes it and refuses a short frame, else into its
    own arrays and copied (under a MAC: ``copy`` is not kept without one); either way one batch
    per call and bit-exact loads."""
    _install_fake(monkeypatch, _fake_nvcomp(into=into))
    frames = NvcompFrames(torch.device("cpu"), None)
    device = decoder(kv_tensors(1), frames, authenticated=not into)
    device.self_test()
    assert frames.mode == ("into" if into else "copy")
    payload = payload_of(tensors, [3, 4])
    ok, failure, _ = load(device, CODEC.encode(payload), [5, 6])
    assert ok and failure is None
    assert payload_of(device.copier.tensors, [5, 6]) == payload
    hostile_stored = hostile("frame-short-content", CODEC.encode(payload))[0]
    ok, failure, _ = load(device, hostile_stored, [7, 8])
    assert not ok
    device.close()


def test_out_that_accepts_a_lying_frame_is_not_used_unchecked(tensors, monkeypatch):
    """nvCOMP taking ``out=`` but decoding a short frame without an error (its tail stale), and
    no checksum verified before decoding (verify=header): not kept; nor is the copying mode, whose
    size check refuses that frame, without a MAC (its outputs are nvCOMP's, out of the check's
    sight); with one it is kept."""
    _install_fake(monkeypatch, _fake_nvcomp(into=True, lenient="into"))
    device = decoder(kv_tensors(1), NvcompFrames(torch.device("cpu"), None), checked=False)
    with pytest.raises(InputError, match="into: a frame holding fewer.*copy: decodes into nvCOMP's own buffers"):
        device.self_test()
    device.close()
    frames = NvcompFrames(torch.device("cpu"), None)
    device = decoder(kv_tensors(1), frames, checked=False, authenticated=True)
    device.self_test()
    assert frames.mode == "copy" and not device.lax_frames
    device.close()


def test_sized_configs_decode_bit_exact_and_are_built_once_per_step_shape(tensors, monkeypatch):
    """nvCOMP with configs from sizes (no header read back, no stream synchronization) that still
    refuses a lying frame: the start check keeps ``sized``; a config is built once per tuple of
    plane sizes and reused."""
    fake = _fake_nvcomp(into=True, sized=True)
    _install_fake(monkeypatch, fake)
    frames = NvcompFrames(torch.device("cpu"), None)
    device = decoder(kv_tensors(1), frames)
    device.self_test()
    assert frames.mode == "sized"
    payload = payload_of(tensors, [3, 4])
    built = fake.Codec.configs_built
    for ids in ([5, 6], [7, 8]):
        ok, failure, _ = load(device, CODEC.encode(payload), ids)
        assert ok and failure is None
        assert payload_of(device.copier.tensors, ids) == payload
    assert fake.Codec.configs_built == built + 1
    ok, _, _ = load(device, hostile("frame-short-content", CODEC.encode(payload))[0], [9, 10])
    assert not ok
    device.close()


def test_sized_configs_silent_on_a_lying_frame_are_not_used_unchecked(tensors, monkeypatch):
    _install_fake(monkeypatch, _fake_nvcomp(into=True, sized=True, lenient="sized"))
    frames = NvcompFrames(torch.device("cpu"), None)
    device = decoder(kv_tensors(1), frames, checked=False)
    device.self_test()
    assert frames.mode == "into"
    device.close()


def test_a_decoder_silent_on_lying_frames_either_way_fails_the_start_check_unchecked(tensors, monkeypatch):
    _install_fake(monkeypatch, _fake_nvcomp(into=True, lenient="both"))
    device = decoder(kv_tensors(1), NvcompFrames(torch.device("cpu"), None), checked=False)
    with pytest.raises(InputError, match="start check") as refused:
        device.self_test()
    assert "bytes than it declares" in str(refused.value) and "verify=full" in str(refused.value)
    assert "\n" not in str(refused.value)
    device.close()


def test_the_start_check_refuses_a_decoder_that_accepts_a_lying_frame(tensors):
    class Lenient(HostFrames):
        def decode(self, source, frames, target, outputs):
            for frame, out in zip(frames, outputs):
                try:
                    super().decode(source, frame[None], target, out[None])
                except Exception:  # noqa: BLE001 - swallowed: what the check must notice
                    pass
            return torch.zeros((), dtype=torch.bool), None
    with pytest.raises(InputError, match="bytes than it declares"):
        decoder(tensors, Lenient(CODEC), checked=False).self_test()
    lax = decoder(tensors, Lenient(CODEC))  # the stored bytes checked first: kept, and said so
    lax.self_test()
    assert lax.lax_frames


@pytest.mark.parametrize("holding", [(1 << 16) - 4096, (1 << 16) + 4096, 300, 70_000])
def test_a_lying_frame_passes_the_header_check_and_fails_decoding(holding):
    frame = lying_frame(1 << 16, holding)
    CODEC.check_frame(frame, 1 << 16)  # the header declares exactly the plane
    with pytest.raises(CodecError):
        CODEC.inflate(memoryview(frame), np.empty(1 << 16, dtype=np.uint8))


@pytest.mark.parametrize("case", ["table-zero", "frame-corrupt"])
def test_a_step_of_several_loads_fails_only_the_block_its_decoder_refuses(tensors, case):
    """Three loads in one step (one frame-decoder call): a block refused on the host (its table)
    or by the frame decoder makes the step raise; issued again block by block, only that block
    fails (Step.CHECK, its rows untouched) and the others load bit-exact."""
    from pykv.connector.device_codec import _Work
    device = decoder(tensors, step_blocks=3)
    payloads = [payload_of(kv_tensors(20 + i), [0, 1]) for i in range(3)]
    stored = [CODEC.encode(p) for p in payloads]
    stored[1] = hostile(case, stored[1])[0]
    ids = [[6, 7], [8, 9], [10, 11]]
    before = [t.clone() for t in tensors]
    ends = Ends()
    works = [_Work(False, CodedLoad(CopyTask(torch.frombuffer(bytearray(s), dtype=torch.int8), 0, np.asarray(i), 0,
                                             token=n), RAW, CODEC.params), ends)
             for n, (s, i) in enumerate(zip(stored, ids))]
    device._run_now(works)
    calls = {task.token: (ok, failure) for task, ok, failure in ends.wait(3)}
    assert [calls[n][0] for n in range(3)] == [True, False, True]
    assert calls[1][1].step is Step.CHECK
    assert payload_of(tensors, ids[0]) == payloads[0] and payload_of(tensors, ids[2]) == payloads[2]
    assert payload_of(tensors, ids[1]) == payload_of(before, ids[1])
    device.close()


def test_the_workers_start_line_says_where_blocks_are_decoded(tensors):
    from pykv.connector.codecs import where_decoded
    assert where_decoded(codec_for("none"), None) == ""
    assert where_decoded(CODEC, None) == ", decoded on the codec threads"
    device = decoder(tensors, step_blocks=3)
    assert where_decoded(CODEC, device) == ", decoded by DevicePlanesZstd (3 blocks per device step)"
    device.close()


@pytest.mark.parametrize("sized", [False, True])
def test_without_array_interfaces_the_slices_modes_are_chosen(tensors, monkeypatch, sized):
    """nvCOMP refusing ``DeviceBytes`` (no CUDA Array Interface support): the start check passes
    over the interface modes and keeps the same decode with torch slices."""
    _install_fake(monkeypatch, _fake_nvcomp(into=True, sized=sized, interface=False))
    frames = NvcompFrames(torch.device("cpu"), None)
    device = decoder(kv_tensors(1), frames)
    device.self_test()
    assert frames.mode == ("sized-slices" if sized else "into-slices")
    payload = payload_of(tensors, [3, 4])
    ok, failure, _ = load(device, CODEC.encode(payload), [5, 6])
    assert ok and failure is None and payload_of(device.copier.tensors, [5, 6]) == payload
    device.close()


@pytest.mark.parametrize("mode", NvcompFrames.modes)
def test_a_step_of_several_loads_through_nvcomp_is_bit_exact_in_every_mode(tensors, monkeypatch, mode):
    """Four loads in one step (frames of all packed into the stored scratch, raw planes straight
    into the planes scratch, one decoder call), mixed whole and partial chunks: each block's rows
    get exactly its payload's pages."""
    from pykv.connector.device_codec import _Work
    import fake_libnvcomp
    _install_fake(monkeypatch, _fake_nvcomp(into=True, sized=True))
    fake_libnvcomp.install(monkeypatch, fake_libnvcomp.fake_library())
    frames = NvcompFrames(torch.device("cpu"), None)
    device = decoder(tensors, frames, step_blocks=4)
    frames.mode = mode
    payloads = [payload_of(kv_tensors(40 + i), [0, 1]) for i in range(4)]
    plan = [([2, 3], 0), ([9, 8], 0), ([13], 1), ([0, 5], 0)]
    ends = Ends()
    works = [_Work(False, CodedLoad(CopyTask(torch.frombuffer(bytearray(CODEC.encode(p)), dtype=torch.int8), 0,
                                             np.asarray(ids), skip, token=n), RAW, CODEC.params), ends)
             for n, (p, (ids, skip)) in enumerate(zip(payloads, plan))]
    device._run_now(works)
    assert all(ok for _, ok, _ in ends.wait(4))
    assert payload_of(tensors, [2, 3]) == payloads[0] and payload_of(tensors, [9, 8]) == payloads[1]
    assert payload_of(tensors, [0, 5]) == payloads[3]
    page = torch.frombuffer(bytearray(payloads[2]), dtype=torch.int8)
    assert torch.equal(tensors[0][13], page[PAGE:2 * PAGE]) and torch.equal(tensors[1][13], page[3 * PAGE:])
    device.close()


class Overrunning(HostFrames):
    """Decodes right, then writes 16 bytes past each output (through the raw pointer)."""

    def decode(self, source, frames, target, outputs):
        flag, kept = super().decode(source, frames, target, outputs)
        for into, size in outputs.tolist():
            ctypes.memset(target.data_ptr() + into + size, 1, 16)
        return flag, kept


def test_a_decoder_writing_outside_its_plane_is_refused_even_checked(tensors):
    with pytest.raises(InputError, match="outside its plane") as refused:
        decoder(tensors, Overrunning(CODEC)).self_test()
    assert "\n" not in str(refused.value)


def test_a_lax_decoder_is_kept_where_the_stored_bytes_are_checked(tensors, monkeypatch):
    """nvCOMP 6.0 as the H200 showed it (run 22): a frame holding fewer bytes than it declares
    decodes without an error in every mode. With the stored bytes checked first, the start check
    keeps the first mode and says it is lax."""
    _install_fake(monkeypatch, _fake_nvcomp(into=True, sized=True, lenient="both"))
    frames = NvcompFrames(torch.device("cpu"), None)
    device = decoder(kv_tensors(1), frames)
    device.self_test()
    assert frames.mode == "sized" and device.lax_frames
    payload = payload_of(tensors, [3, 4])
    ok, _, _ = load(device, CODEC.encode(payload), [5, 6])
    assert ok and payload_of(device.copier.tensors, [5, 6]) == payload
    device.close()


def test_a_short_frame_never_shows_an_earlier_steps_bytes(monkeypatch):
    """A lax decoder leaves a short frame's tail unwritten: the planes are zeroed each step, so
    the hostile block loads the same KV whatever the decoder held before (never another block's
    bytes)."""
    _install_fake(monkeypatch, _fake_nvcomp(into=True, lenient="both"))
    hostile_stored = hostile("frame-short-content", CODEC.encode(payload_of(kv_tensors(6), [0, 1])))[0]
    loaded = []
    for earlier in (7, 8):
        tensors = kv_tensors(earlier)
        device = decoder(tensors, NvcompFrames(torch.device("cpu"), None))
        device.self_test()
        assert device.lax_frames
        ok, _, _ = load(device, CODEC.encode(payload_of(kv_tensors(earlier + 10), [0, 1])), [2, 3])
        assert ok
        ok, _, _ = load(device, hostile_stored, [9, 10])
        assert ok  # not refused by this decoder: the checksum is what catches it (verify=full)
        loaded.append(payload_of(tensors, [9, 10]))
        device.close()
    assert loaded[0] == loaded[1]


@pytest.mark.parametrize("keys,checked", [({}, True), ({"verify": "header"}, False),
                                          ({"verify": "header", "auth_key_file": "/k"}, True)])
def test_device_codec_for_tells_the_decoder_whether_stored_bytes_are_checked(monkeypatch, keys, checked):
    """``checked`` (what lets a lax nvCOMP be used) follows verify=full or a MAC key;
    ``authenticated`` (what lets an overrunning one be used) a MAC key only."""
    import pykv.connector.device_zstd as device_zstd
    made = []

    class Recording:
        def __init__(self, codec, copier, largest, *, checked, authenticated, step_blocks):
            assert step_blocks is None  # codec_step_blocks auto: the decoder's own bound
            made.append((checked, authenticated))

        def self_test(self):
            pass

    monkeypatch.setattr(device_zstd, "DevicePlanesZstd", Recording)
    copier = types.SimpleNamespace(tensors=[types.SimpleNamespace(device=torch.device("cuda", 0))])
    device_codec_for(codec_for("planes-zstd"), config(codec="planes-zstd", **keys), copier, [RAW])
    assert made == [(checked, "auth_key_file" in keys)]


def test_a_decoder_writing_past_a_lying_frames_plane_is_kept_only_with_a_mac(tensors, monkeypatch):
    """nvCOMP 6.0 as the H100 showed it (run 23): every mode that decodes into given outputs writes
    all of a frame holding more bytes than it declares. Checked by a checksum only, no mode is kept
    (``copy`` decodes into nvCOMP's own buffers, where such a write is unseen); with a MAC (no stored bytes but pykv's own reach the decoder) it keeps
    the first mode, and loads stay bit-exact."""
    _install_fake(monkeypatch, _fake_nvcomp(into=True, sized=True, lenient="both", overrun=True))
    checksummed = NvcompFrames(torch.device("cpu"), None)
    device = decoder(kv_tensors(1), checksummed)
    with pytest.raises(InputError, match="copy: decodes into nvCOMP's own buffers"):
        device.self_test()  # nor the copy mode: its outputs are nvCOMP's, out of the check's sight
    device.close()
    authenticated = NvcompFrames(torch.device("cpu"), None)
    device = decoder(kv_tensors(1), authenticated, authenticated=True)
    device.self_test()
    assert authenticated.mode == "sized" and device.overrunning and device.lax_frames
    payload = payload_of(tensors, [3, 4])
    ok, _, _ = load(device, CODEC.encode(payload), [5, 6])
    assert ok and payload_of(device.copier.tensors, [5, 6]) == payload
    device.close()


def test_a_decoder_overrunning_a_good_frame_is_refused_even_with_a_mac(tensors):
    with pytest.raises(InputError, match="outside its plane"):
        decoder(tensors, Overrunning(CODEC), authenticated=True).self_test()
