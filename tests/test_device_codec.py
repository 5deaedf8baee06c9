"""``DeviceFp8`` (pykv/connector/device_codec.py) on CPU KV tensors: a store leaves exactly
``Fp8Codec.encode`` of the block's payload in the slot, a load writes the round trip of that
payload into exactly the block's KV rows and never changes the slot; hostile coded blocks are
``Step.CHECK`` failures; the CUDA path's threads (streams and events faked) end each block once.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from test_cuda_copier_threads import fake_cuda  # noqa: E402,F401  (fixture)
import device_rig  # noqa: E402
from device_rig import Ends  # noqa: E402

from pykv.codec.fp8 import Fp8Codec  # noqa: E402
from pykv.connector.copier import CopyTask, TorchCopier  # noqa: E402
from pykv.connector.device_codec import CodedLoad, DeviceFp8  # noqa: E402
from pykv.connector.layout import BlockLayout, RefPage  # noqa: E402
from pykv.errors import InputError  # noqa: E402
from pykv.failures import Step  # noqa: E402

BPC = 2
NUM_BLOCKS = 16
PAGE = 256  # bytes of one block's page in each KV tensor: 128 bf16 values, two groups of 64
LAYOUT = BlockLayout(BPC, 64, ((RefPage(0, PAGE), RefPage(1, PAGE)),))
RAW = 2 * BPC * PAGE
CODEC = Fp8Codec("bfloat16")


def kv_tensors(seed: int = 0) -> list[torch.Tensor]:
    return device_rig.kv_tensors(NUM_BLOCKS, PAGE, (1, 2), seed)


def gathered(tensors, ids, skip=0) -> bytes:
    return device_rig.gathered(LAYOUT, RAW, tensors, ids, skip)


def store_one(device: DeviceFp8, ids) -> tuple[torch.Tensor, int]:
    slot = torch.zeros(RAW, dtype=torch.int8)
    ends = Ends()
    device.store([CopyTask(slot, 0, np.asarray(ids), 0)], ends)
    [(_, ok, stored)] = ends.wait(1)
    assert ok
    return slot, stored


def load(device: DeviceFp8, stored: bytes, ids, skip=0, raw=RAW, params=CODEC.params):
    return device_rig.coded_load(device, stored, ids, raw, params, skip)


@pytest.fixture
def tensors():
    return kv_tensors()


def test_a_store_leaves_the_codecs_encoding_of_the_payload_in_the_slot(tensors):
    device = DeviceFp8(CODEC, TorchCopier(tensors, LAYOUT), [RAW])
    slot, stored = store_one(device, [5, 9])
    expected = CODEC.encode(gathered(tensors, [5, 9]))
    assert stored == len(expected) == CODEC.stored_length(RAW) == RAW // 2 + RAW // 128  # codes, scale bytes
    assert slot.numpy().tobytes()[:stored] == expected


def test_a_load_writes_the_round_trip_into_the_blocks_rows_only_and_keeps_the_slot(tensors):
    source = kv_tensors(seed=1)
    stored = CODEC.encode(gathered(source, [2, 3]))
    before = [t.clone() for t in tensors]
    ok, failure, slot = load(DeviceFp8(CODEC, TorchCopier(tensors, LAYOUT), [RAW]), stored, [7, 12])
    assert ok and failure is None
    assert slot.numpy().tobytes() == stored  # a DRAM-tier slot serves the next hit unchanged
    expected = [t.clone() for t in before]
    round_trip = torch.frombuffer(bytearray(CODEC.decode_bytes(stored, RAW)), dtype=torch.int8)
    TorchCopier(expected, LAYOUT).from_slots([CopyTask(round_trip, 0, np.asarray([7, 12]), 0)], lambda t, ok: None)
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected))
    changed = [i for i in range(NUM_BLOCKS) if not torch.equal(tensors[0][i], before[0][i])]
    assert changed == [7, 12]


def test_a_load_after_a_prefix_hit_writes_only_the_uncovered_sub_block(tensors):
    source = kv_tensors(seed=2)
    stored = CODEC.encode(gathered(source, [0, 1]))
    before = [t.clone() for t in tensors]
    ok, _, _ = load(DeviceFp8(CODEC, TorchCopier(tensors, LAYOUT), [RAW]), stored, [4], skip=1)
    assert ok
    round_trip = torch.frombuffer(bytearray(CODEC.decode_bytes(stored, RAW)), dtype=torch.bfloat16)
    second_page_of_ref0 = round_trip[PAGE // 2:PAGE]  # ref 0's run: sub-block 0 then sub-block 1
    assert torch.equal(tensors[0][4].view(torch.bfloat16), second_page_of_ref0)
    assert all(torch.equal(tensors[0][i], before[0][i]) for i in range(NUM_BLOCKS) if i != 4)


@pytest.mark.parametrize("case", ["other-codec", "short", "long", "raw-not-groups", "raw-too-large", "raw-zero"])
def test_hostile_coded_blocks_are_check_failures_and_touch_no_kv(tensors, case):
    stored = CODEC.encode(gathered(kv_tensors(seed=3), [0, 1]))
    params, raw = CODEC.params, RAW
    if case == "other-codec":
        params = Fp8Codec("float16").params
    elif case == "short":
        stored = stored[:-1]
    elif case == "long":
        stored = stored + b"\0"
    elif case == "raw-not-groups":
        raw = RAW - 2
    elif case == "raw-too-large":
        raw, stored = 2 * RAW, CODEC.encode(bytes(2 * RAW))
    elif case == "raw-zero":
        raw, stored = 0, b"\0" * 4
    before = [t.clone() for t in tensors]
    ok, failure, _ = load(DeviceFp8(CODEC, TorchCopier(tensors, LAYOUT), [RAW]), stored, [3, 4], raw=raw,
                          params=params)
    assert not ok and failure.step is Step.CHECK
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


@pytest.mark.parametrize("scale", [0, 255, 247])  # exponents -127, 128 (E8M0's NaN), 120 > bf16's 119
def test_a_scale_the_encoder_never_writes_fails_the_load(tensors, scale):
    stored = bytearray(CODEC.encode(gathered(kv_tensors(seed=4), [0, 1])))
    assert 1 <= stored[3] <= 127 + 119  # group 3's scale byte, as encoded
    stored[3] = scale
    ok, failure, _ = load(DeviceFp8(CODEC, TorchCopier(tensors, LAYOUT), [RAW]), bytes(stored), [3, 4])
    assert not ok and failure.step is Step.CHECK


def test_a_nan_code_fails_the_load(tensors):
    stored = bytearray(CODEC.encode(gathered(kv_tensors(seed=5), [0, 1])))
    stored[-3] = 0x7F
    ok, failure, _ = load(DeviceFp8(CODEC, TorchCopier(tensors, LAYOUT), [RAW]), bytes(stored), [3, 4])
    assert not ok and failure.step is Step.CHECK


def test_kv_holding_nan_is_not_stored(tensors, caplog):
    tensors[1].view(torch.bfloat16)[6, 17] = float("nan")
    device = DeviceFp8(CODEC, TorchCopier(tensors, LAYOUT), [RAW])
    ends = Ends()
    with caplog.at_level(logging.WARNING):
        device.store([CopyTask(torch.zeros(RAW, dtype=torch.int8), 0, np.asarray([5, 6]), 0)], ends)
    assert [(ok, stored) for _, ok, stored in ends.wait(1)] == [(False, None)]
    assert "NaN or infinite" in caplog.text


def test_a_layout_that_is_not_whole_groups_is_refused_at_start(tensors):
    with pytest.raises(InputError, match="whole groups of 64 values") as refused:
        DeviceFp8(CODEC, TorchCopier(tensors, LAYOUT), [RAW, 3 * 64])
    assert "\n" not in str(refused.value)


def test_the_stream_path_ends_every_block_once_with_the_same_bytes(tensors, fake_cuda):
    """The CUDA path's issuing and polling threads (streams and events faked): more blocks than
    flags in flight, stores and loads mixed; each ends once, with the synchronous path's result."""
    device = DeviceFp8(CODEC, TorchCopier(tensors, LAYOUT), [RAW], streams=True)
    source = kv_tensors(seed=6)
    stored = CODEC.encode(gathered(source, [0, 1]))
    ends = Ends()
    slots = [torch.zeros(RAW, dtype=torch.int8) for _ in range(40)]
    for i, slot in enumerate(slots):
        device.store([CopyTask(slot, 0, np.asarray([2 * (i % 8), 2 * (i % 8) + 1]), 0, token=("s", i))], ends)
        loaded = torch.frombuffer(bytearray(stored), dtype=torch.int8)
        device.load([CodedLoad(CopyTask(loaded, 0, np.asarray([1, 3]), 0, token=("l", i)), RAW, CODEC.params)],
                    ends)
    calls = ends.wait(80)
    device.close(timeout=5)
    assert sorted(task.token for task, _, _ in calls) == sorted([("s", i) for i in range(40)] + [("l", i) for i in range(40)])
    assert all(ok for _, ok, _ in calls)
    for task, _, stored_length in calls:
        if task.token[0] == "s":
            assert stored_length == CODEC.stored_length(RAW)
    reference = kv_tensors()
    for i, slot in enumerate(slots[:8]):
        pair = [2 * i, 2 * i + 1]
        if 1 in pair or 3 in pair:  # blocks the loads wrote (interleaved with these stores)
            continue
        assert slot.numpy().tobytes()[:CODEC.stored_length(RAW)] == CODEC.encode(gathered(reference, pair))
    assert not any(t.is_alive() for t in device._threads)


def _loads(blocks, raw=RAW):
    return device_rig.coded_loads(blocks, raw, CODEC.params)


def test_a_step_of_several_loads_writes_each_round_trip_and_fails_only_the_hostile_block(tensors):
    """Several loads decoded in one step (one dequantize over all rows, one scatter): each good
    block's rows get its own round trip; a block with a scale the encoder never writes fails
    alone, by its own flag (its rows, written in the same scatter, are recomputed by vLLM as
    for any failed load)."""
    from pykv.connector.device_codec import _Work
    device = DeviceFp8(CODEC, TorchCopier(tensors, LAYOUT), [RAW], step_blocks=4)
    sources = [gathered(kv_tensors(seed=10 + i), [0, 1]) for i in range(4)]
    blocks = [(CODEC.encode(p), [2 * i + 6, 2 * i + 7]) for i, p in enumerate(sources)]
    hostile = bytearray(blocks[2][0])
    hostile[0] = 255  # group 0's scale: E8M0's NaN
    blocks[2] = (bytes(hostile), blocks[2][1])
    before = [t.clone() for t in tensors]
    loads, ends = _loads(blocks)
    device._run_now([_Work(False, load, ends) for load in loads])
    calls = {task.token: (ok, failure) for task, ok, failure in ends.wait(4)}
    assert [calls[i][0] for i in range(4)] == [True, True, False, True]
    assert calls[2][1].step is Step.CHECK
    for i, source in enumerate(sources):
        if i != 2:
            assert gathered(tensors, blocks[i][1]) == CODEC.decode_bytes(CODEC.encode(source), RAW)
    assert gathered(tensors, [0, 1]) == gathered(before, [0, 1])  # rows of no load untouched
    device.close()


def test_a_step_takes_the_queued_loads_of_one_length_and_leaves_the_rest(tensors):
    from pykv.connector.device_codec import _Work
    device = DeviceFp8(CODEC, TorchCopier(tensors, LAYOUT), [RAW, 2 * RAW], step_blocks=3)
    device.close()
    stored = CODEC.encode(bytes(RAW))
    loads, ends = _loads([(stored, [0, 1])] * 5)
    works = [_Work(False, load, ends) for load in loads]
    longer = _Work(False, CodedLoad(loads[0].task, 2 * RAW, CODEC.params), ends)
    store = _Work(True, CopyTask(torch.zeros(RAW, dtype=torch.int8), 0, np.asarray([0, 1]), 0), ends)
    for work in [*works[:4], longer, store, works[4], None]:
        device._queued.put(work)
    assert device._take() == works[:3]  # step_blocks at most
    assert device._take() == [works[3]]  # another length ends the step
    assert device._take() == [longer]
    assert device._take() == [store]  # a store is a step of its own
    assert device._take() == [works[4]]
    assert device._take() is None


def test_step_blocks_follow_the_scratch_bound():
    from pykv.connector.device_codec import MAX_STEP_BLOCKS, STEP_BYTES
    tensors = kv_tensors()
    assert DeviceFp8(CODEC, TorchCopier(tensors, LAYOUT), [RAW]).step_blocks == MAX_STEP_BLOCKS  # small blocks
    big = STEP_BYTES // 3 // 128 * 128
    device = DeviceFp8(CODEC, TorchCopier(tensors, LAYOUT), [big])
    assert device.step_blocks == 3 and device.payload.numel() == 3 * big
