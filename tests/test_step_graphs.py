"""``StepGraphs`` (pykv/connector/step_graphs.py) under ``DeviceFp8`` on CPU KV tensors, the CUDA
graph faked by a backend whose replay runs the captured body again (as a graph does: the same
kernels over the same buffers, the ids read from the device buffer at replay time): every step
writes each block's round trip into exactly its blocks, the second step of a shape is captured
and replayed, partial chunks never are, a hostile block in a replayed step fails alone, and a
capture that fails turns the graphs off with one warning and loses no block.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

import device_rig  # noqa: E402

from pykv.codec.fp8 import Fp8Codec  # noqa: E402
from pykv.connector.copier import TorchCopier  # noqa: E402
from pykv.connector.device_codec import DeviceFp8, _Work  # noqa: E402
from pykv.connector.layout import BlockLayout, RefPage  # noqa: E402
from pykv.connector.step_graphs import StepGraphs  # noqa: E402
from pykv.failures import Step  # noqa: E402

BPC = 2
NUM_BLOCKS = 24
PAGE = 256
LAYOUT = BlockLayout(BPC, 64, ((RefPage(0, PAGE), RefPage(1, PAGE)),))
RAW = 2 * BPC * PAGE
CODEC = Fp8Codec("bfloat16")


class FakeGraph:
    def __init__(self, body, output):
        self.body, self.output, self.replays = body, output, 0

    def replay(self):
        self.replays += 1
        self.output.copy_(self.body())


class FakeBackend:
    """Capture records the body (running it, where a real capture only records, is harmless
    here: the replay that follows writes the same bytes); ``fail`` makes capturing raise."""

    def __init__(self, fail: bool = False):
        self.fail, self.graphs = fail, []

    def capture(self, body):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        graph = FakeGraph(body, body().clone())
        self.graphs.append(graph)
        return graph, graph.output

    def event(self):  # pragma: no cover - CPU ids need no events
        raise AssertionError("no events for CPU ids")


def gathered(tensors, ids, skip=0) -> bytes:
    return device_rig.gathered(LAYOUT, RAW, tensors, ids, skip)


def device_with(backend, tensors, step_blocks=3):
    return DeviceFp8(CODEC, TorchCopier(tensors, LAYOUT), [RAW], step_blocks=step_blocks, graphs=True,
                     graph_backend=backend)


def run_step(device, blocks, skip=0):
    """One step of loads ``(stored bytes, gpu ids)``; {index: (ok, failure)}."""
    loads, ends = device_rig.coded_loads(blocks, RAW, CODEC.params, skip)
    device._run_now([_Work(False, load, ends) for load in loads])
    return {task.token: (ok, failure) for task, ok, failure in ends.wait(len(blocks))}


def sources(count, seed):
    return [gathered(device_rig.kv_tensors(NUM_BLOCKS, PAGE, (1, 2), seed + i), [0, 1]) for i in range(count)]


def test_the_second_step_of_a_shape_is_replayed_and_every_step_writes_its_own_blocks():
    tensors = device_rig.kv_tensors(NUM_BLOCKS, PAGE, (1, 2), 0)
    backend = FakeBackend()
    device = device_with(backend, tensors)
    steps = [[[4, 5], [10, 11], [0, 1]], [[7, 6], [2, 3], [20, 21]], [[13, 12], [9, 8], [17, 16]]]
    for n, step in enumerate(steps):
        payloads = sources(3, seed=30 + 10 * n)
        before = [t.clone() for t in tensors]
        calls = run_step(device, [(CODEC.encode(p), ids) for p, ids in zip(payloads, step)])
        assert all(ok for ok, _ in calls.values())
        for payload, ids in zip(payloads, step):
            assert gathered(tensors, ids) == CODEC.decode_bytes(CODEC.encode(payload), RAW)
        written = {i for ids in step for i in ids}
        untouched = [i for i in range(NUM_BLOCKS) if i not in written]
        assert gathered(tensors, untouched[:2]) == gathered(before, untouched[:2])
    assert len(backend.graphs) == 1 and backend.graphs[0].replays == 2
    assert device.stats["codec_graph_steps"] == 2 and device.stats["codec_graphs"] == 1
    device.close()


def test_partial_chunks_and_a_new_count_run_kernel_by_kernel():
    tensors = device_rig.kv_tensors(NUM_BLOCKS, PAGE, (1, 2), 0)
    backend = FakeBackend()
    device = device_with(backend, tensors)
    payload = sources(1, seed=50)[0]
    for _ in range(3):  # one block after a prefix hit: never a graph
        calls = run_step(device, [(CODEC.encode(payload), [9])], skip=1)
        assert calls[0][0]
        round_trip = torch.frombuffer(bytearray(CODEC.decode_bytes(CODEC.encode(payload), RAW)), dtype=torch.bfloat16)
        assert torch.equal(tensors[0][9].view(torch.bfloat16), round_trip[PAGE // 2:PAGE])  # ref 0's sub-block 1
    run_step(device, [(CODEC.encode(payload), [2, 3])])  # a new shape: its first step runs as it is
    assert backend.graphs == [] and device.stats["codec_graph_steps"] == 0
    device.close()


def test_a_hostile_block_in_a_replayed_step_fails_alone():
    tensors = device_rig.kv_tensors(NUM_BLOCKS, PAGE, (1, 2), 0)
    device = device_with(FakeBackend(), tensors)
    payloads = sources(2, seed=70)
    run_step(device, [(CODEC.encode(p), ids) for p, ids in zip(payloads, [[0, 1], [2, 3]])])
    hostile = bytearray(CODEC.encode(payloads[1]))
    hostile[0] = 255  # a scale the encoder never writes
    calls = run_step(device, [(CODEC.encode(payloads[0]), [5, 4]), (bytes(hostile), [6, 7])])
    assert device.stats["codec_graph_steps"] == 1
    assert calls[0][0] and not calls[1][0] and calls[1][1].step is Step.CHECK
    assert gathered(tensors, [5, 4]) == CODEC.decode_bytes(CODEC.encode(payloads[0]), RAW)
    device.close()


def test_ids_outside_the_kv_fail_before_any_device_work_and_only_their_block():
    tensors = device_rig.kv_tensors(NUM_BLOCKS, PAGE, (1, 2), 0)
    device = device_with(FakeBackend(), tensors)
    payloads = sources(2, seed=80)
    run_step(device, [(CODEC.encode(p), ids) for p, ids in zip(payloads, [[0, 1], [2, 3]])])
    before = [t.clone() for t in tensors]
    calls = run_step(device, [(CODEC.encode(payloads[0]), [5, 4]), (CODEC.encode(payloads[1]), [NUM_BLOCKS, 1])])
    assert calls[0][0] and not calls[1][0]
    assert gathered(tensors, [5, 4]) == CODEC.decode_bytes(CODEC.encode(payloads[0]), RAW)
    assert gathered(tensors, [0, 1]) == gathered(before, [0, 1])
    device.close()


def test_a_failed_capture_turns_the_graphs_off_and_loses_no_block(caplog):
    tensors = device_rig.kv_tensors(NUM_BLOCKS, PAGE, (1, 2), 0)
    device = device_with(FakeBackend(fail=True), tensors)
    with caplog.at_level(logging.WARNING, logger="pykv.connector.step_graphs"):
        for n in range(3):
            payloads = sources(2, seed=90 + n)
            calls = run_step(device, [(CODEC.encode(p), ids) for p, ids in zip(payloads, [[0, 1], [2, 3]])])
            assert all(ok for ok, _ in calls.values())
            assert gathered(tensors, [2, 3]) == CODEC.decode_bytes(CODEC.encode(payloads[1]), RAW)
    assert not device.graphs.enabled and device.stats["codec_graph_steps"] == 0
    assert len([r for r in caplog.records if "CUDA graph" in r.message]) == 1
    device.close()


def test_without_cuda_or_a_backend_there_are_no_graphs():
    device = DeviceFp8(CODEC, TorchCopier(device_rig.kv_tensors(NUM_BLOCKS, PAGE, (1, 2), 0), LAYOUT), [RAW],
                       graphs=True)
    assert device.graphs is None
    device.close()


def test_more_ids_than_the_buffer_holds_are_refused():
    graphs = StepGraphs(torch.device("cpu"), 4, rows=2, backend=FakeBackend())
    with pytest.raises(ValueError):
        graphs.run("k", np.arange(5), lambda: torch.zeros(1))
    for n in range(3):  # rows reused in turn; the buffer holds the latest ids
        graphs.run("k", np.arange(n, n + 4), lambda: graphs.ids.clone())
        assert graphs.ids.tolist() == list(range(n, n + 4))


def test_codec_graphs_is_off_by_default_and_reaches_the_device_codec(monkeypatch):
    from pykv.config import PykvConfig
    from pykv.connector import codecs as codecs_module
    from pykv.connector import device_codec as device_codec_module

    assert PykvConfig.from_extra_config({"root": "/tmp/x"}).codec_graphs is False
    seen = []

    class Recorder(DeviceFp8):
        def __init__(self, *args, graphs=False, **kwargs):
            seen.append(graphs)
            super().__init__(*args, graphs=graphs, **kwargs)

    monkeypatch.setattr(device_codec_module, "DeviceFp8", Recorder)
    copier = TorchCopier(device_rig.kv_tensors(NUM_BLOCKS, PAGE, (1, 2), 0), LAYOUT)
    for value, expected in (("true", True), ("false", False)):
        pykv = PykvConfig.from_extra_config({"root": "/tmp/x", "codec": "fp8", "codec_graphs": value})
        codecs_module.device_codec_for(CODEC, pykv, copier, [RAW]).close()
        assert seen[-1] is expected
