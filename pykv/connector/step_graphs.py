"""A device codec's load steps replayed as CUDA graphs (``codec_graphs``).

Every torch call of a step gives the GIL up and must take it back beside vLLM's engine loop
(``pykv.gil``): an ``fp8`` step of whole chunks is a dozen dequantizing calls and one
``index_put_`` per KV tensor. Such a step differs from the last one of its shape only in its GPU
block ids, so ``StepGraphs`` captures it once per shape (a key: blocks, raw length, KV group) with
the ids read from one device buffer (``ids``), and then runs it with three calls: one copy of the
ids, one graph launch, one event. The first step of a shape runs its body as it is (the same
kernels, reading the same buffer); the second is captured and replayed. A capture that fails
turns the graphs off for the engine, with one warning: every step then runs its body.
"""

from __future__ import annotations

import logging
from typing import Callable, Hashable, Protocol

import numpy as np
import torch

log = logging.getLogger(__name__)

Body = Callable[[], torch.Tensor]
"""A step's device work, queued on the current stream, reading its ids from ``StepGraphs.ids``;
returns its output tensor (a replay rewrites that same tensor)."""


class Replay(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    """What ``StepGraphs`` needs of CUDA (a fake in the CPU tests)."""

    def capture(self, body: Body) -> tuple[Replay, torch.Tensor]: ...

    def event(self) -> object: ...


class CudaGraphBackend:
    """Captures on a stream of its own (never the one that replays), all graphs in one memory
    pool: their steps run one at a time on one stream, so they can share temporaries. The capture
    mode is ``thread_local``: vLLM's threads go on with their own CUDA calls meanwhile."""

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device=device)
        self._pool = torch.cuda.graph_pool_handle()

    def capture(self, body: Body) -> tuple[Replay, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                output = body()
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:  # noqa: BLE001 - the body's error is the one to report
                    pass
                raise
            graph.capture_end()
        return graph, output

    def event(self) -> object:
        return torch.cuda.Event()


class StepGraphs:
    """Graphs of one device codec's steps; ``ids`` is the int64 device buffer (``width`` ids) the
    bodies read. ``rows`` page-locked host rows carry the ids to it, each reused only once its
    last copy has ended (an event per row). At most ``keep`` shapes are captured."""

    def __init__(self, device: torch.device, width: int, *, rows: int = 8, keep: int = 64,
                 backend: GraphBackend | None = None) -> None:
        cuda = device.type == "cuda"
        self.ids = torch.zeros(width, dtype=torch.int64, device=device)
        self._host = torch.zeros((rows, width), dtype=torch.int64, pin_memory=cuda)
        self._host_rows = list(self._host.unbind(0))
        self._host_ids = self._host.numpy()
        self._row_ends: list[object | None] = [None] * rows
        self._next_row = 0
        self._backend = backend if backend is not None else CudaGraphBackend(device)
        self._graphs: dict[Hashable, tuple[Replay, torch.Tensor]] = {}
        self._seen: set[Hashable] = set()
        self._keep = keep
        self.enabled = True

    @property
    def captured(self) -> int:
        """Shapes captured (the engine's ``codec_graphs`` counter)."""
        return len(self._graphs)

    def run(self, key: Hashable, ids: np.ndarray, body: Body) -> tuple[torch.Tensor, bool]:
        """``body``'s output with ``ids`` (at most ``width``) in the first places of ``ids``, its
        work queued on the current stream: replayed where ``key`` was captured, else ``body`` run
        as it is (and captured, then replayed, the second time ``key`` comes). The flag: replayed."""
        self._stage(ids)
        graph = self._graphs.get(key)
        if graph is None and self.enabled and key in self._seen and len(self._graphs) < self._keep:
            graph = self._capture(key, body)
        if graph is None:
            self._seen.add(key)
            return body(), False
        replay, output = graph
        replay.replay()
        return output, True

    def _stage(self, ids: np.ndarray) -> None:
        """``ids`` into the device buffer, through the next host row (after its last copy ended)."""
        if len(ids) > len(self._host_rows[0]):
            raise ValueError(f"{len(ids)} ids for a buffer of {len(self._host_rows[0])}")
        row = self._next_row
        self._next_row = (row + 1) % len(self._host_rows)
        ended = self._row_ends[row]
        if ended is not None:
            ended.synchronize()
        self._host_ids[row, :len(ids)] = ids
        self.ids.copy_(self._host_rows[row], non_blocking=True)
        if self.ids.device.type == "cuda":
            if ended is None:
                ended = self._row_ends[row] = self._backend.event()
            ended.record()

    def _capture(self, key: Hashable, body: Body) -> tuple[Replay, torch.Tensor] | None:
        try:
            graph = self._backend.capture(body)
        except Exception as error:  # noqa: BLE001 - the step runs its body; the engine goes on
            self.enabled = False
            log.warning("pykv: capturing a device codec step as a CUDA graph failed (%s); its steps run "
                        "kernel by kernel from now on (codec_graphs)", error)
            return None
        self._graphs[key] = graph
        return graph
