"""CodecStage: stores encoded in their slot (raw when that does not pay), loads decoded into bounded
scratch buffers, hostile stored bytes a miss, never a hang."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pykv.codec import Codec, CodecError, codec_for
from pykv.codec.stage import SPARE_BUFFERS, CodecStage

SLOT = 1 << 20


def kv_like(n: int, seed: int = 0) -> bytes:
    """bf16-like values: a narrow exponent range, random mantissas (compressible like real KV)."""
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, n // 2).astype(np.float32).view(np.uint32).__rshift__(16).astype(np.uint16).tobytes()


def run(submit, *args):
    """Call ``submit(*args, done)`` and wait for ``done``'s first argument (a decode's buffer; its
    failure in ``run.failure``)."""
    box, event = [], threading.Event()
    submit(*args, lambda value, *failure: (box.append((value, *failure)), event.set()))
    assert event.wait(10), "the stage never answered"
    run.failure = box[0][1] if len(box[0]) > 1 else None
    return box[0][0]


@pytest.fixture
def stage():
    s = CodecStage(codec_for("planes-zstd"), SLOT, threads=2)
    yield s
    s.close()


def test_a_store_is_encoded_in_place_and_decodes_to_its_bytes(stage):
    raw = kv_like(SLOT - 4096)
    slot = bytearray(raw)
    stored = run(stage.encode, memoryview(slot))
    assert stored is not None and stored < len(raw)
    buffer = run(stage.decode, memoryview(slot)[:stored], len(raw), stage.params)
    assert buffer is not None
    assert bytes(stage.view(buffer)[:len(raw)]) == raw
    assert bytes(slot[stored:]) == raw[stored:], "bytes past the stored ones are untouched"
    stage.release(buffer)


def test_an_incompressible_payload_stays_raw(stage):
    raw = np.random.default_rng(1).integers(0, 256, SLOT - 4096, dtype=np.uint8).tobytes()
    slot = bytearray(raw)
    assert run(stage.encode, memoryview(slot)) is None
    assert bytes(slot) == raw


class Refusing(Codec):
    name = "refusing"
    params = "refusing:v1"

    def encoded_bound(self, payload_len: int) -> int:
        return payload_len

    def encode(self, src, out=None):
        raise CodecError(self.name, "non-finite values")

    def decode(self, src, dst):
        raise CodecError(self.name, "corrupt")


def test_a_payload_the_codec_refuses_is_stored_raw_and_a_refused_decode_is_a_miss():
    stage = CodecStage(Refusing(), SLOT, threads=1)
    try:
        slot = bytearray(b"\x01" * 8192)
        assert run(stage.encode, memoryview(slot)) is None
        assert bytes(slot) == b"\x01" * 8192
        assert run(stage.decode, memoryview(slot), 8192, "refusing:v1") is None
        assert run.failure.corrupt and "corrupt" in run.failure.detail
        assert len(stage._free) == stage.scratch.num_slots, "a refused decode gives its buffer back"
    finally:
        stage.close()


def test_stored_bytes_of_another_codec_or_damaged_are_a_miss(stage):
    raw = kv_like(SLOT - 4096, seed=2)
    slot = bytearray(raw)
    stored = run(stage.encode, memoryview(slot))
    assert run(stage.decode, memoryview(slot)[:stored], len(raw), "planes-zstd:v1,elem=2,level=3,chunk=1") is None
    assert run.failure.corrupt, "another codec's block in this namespace is not one this engine wrote"
    damaged = bytearray(slot[:stored])
    damaged[:64] = bytes(64)  # the chunk table: lengths that do not add up
    assert run(stage.decode, memoryview(damaged), len(raw), stage.params) is None
    assert run(stage.decode, memoryview(slot)[:stored // 2], len(raw), stage.params) is None
    assert run(stage.decode, memoryview(slot)[:stored], SLOT * 4, stage.params) is None, "longer than a buffer"
    assert len(stage._free) == stage.scratch.num_slots


def test_decodes_wait_for_a_free_buffer_and_memory_stays_bounded(stage):
    raw = kv_like(SLOT - 4096, seed=3)
    slot = bytearray(raw)
    stored = run(stage.encode, memoryview(slot))
    held = [run(stage.decode, memoryview(slot)[:stored], len(raw), stage.params)
            for _ in range(2 + SPARE_BUFFERS)]
    assert None not in held and len(set(held)) == len(held)
    late = threading.Event()
    stage.decode(memoryview(slot)[:stored], len(raw), stage.params, lambda b, failure: late.set())
    assert not late.wait(0.3), "a decode with no free buffer waits"
    stage.release(held.pop())
    assert late.wait(10)


def test_close_ends_work_still_waiting_for_a_buffer(stage):
    raw = kv_like(SLOT - 4096, seed=4)
    slot = bytearray(raw)
    stored = run(stage.encode, memoryview(slot))
    for _ in range(2 + SPARE_BUFFERS):
        run(stage.decode, memoryview(slot)[:stored], len(raw), stage.params)
    answers = []
    stage.decode(memoryview(slot)[:stored], len(raw), stage.params, lambda b, failure: answers.append((b, failure)))
    closer = threading.Thread(target=stage.close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive() and answers[0][0] is None and not answers[0][1].corrupt


def test_threads_must_be_positive():
    with pytest.raises(ValueError):
        CodecStage(codec_for("planes-zstd"), SLOT, threads=0)


def test_a_process_exits_while_a_decode_waits_for_a_buffer(tmp_path):
    """The stage's threads are daemons: an engine that exits without closing it never hangs."""
    import subprocess
    import sys
    script = tmp_path / "exit.py"
    script.write_text(
        "from pykv.codec import codec_for\n"
        "from pykv.codec.stage import SPARE_BUFFERS, CodecStage\n"
        "stage = CodecStage(codec_for('planes-zstd'), 1 << 20, threads=1)\n"
        "for _ in range(1 + SPARE_BUFFERS):\n"
        "    stage._take()\n"  # every buffer held: the next decode waits
        "stage.decode(memoryview(bytearray(64)), 64, stage.params, lambda b, f: None)\n"
        "print('exiting')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "exiting" in done.stdout
    assert all(thread.daemon for thread in CodecStage(codec_for("planes-zstd"), SLOT, threads=2)._threads)
