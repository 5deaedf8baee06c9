"""Shared by the worker tests: wait for a worker's writes after vLLM already has the store job."""

from __future__ import annotations

import time

from pykv.io.backend import OpKind


def settle_stores(manager, worker, keys, timeout: float = 20.0) -> None:
    """Feed the worker's reports to the manager until every key's write has ended.

    With early release a store through DRAM slots is finished for vLLM as soon as the blocks
    are in their slots; the files are written afterwards and reported in ``stores_ended``.
    Keys stored without a DRAM slot were written before their job finished: nothing to wait for.
    """
    pending = {k for k in keys if manager.dram.entry(k) is not None and k in manager.residency.writes()}
    deadline = time.monotonic() + timeout
    while True:
        report = worker.take_report()
        if report:
            manager.on_worker_report(report)
        pending &= set(manager.residency.writes())  # every rank's end reported: no longer written
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"writes of {len(pending)} blocks did not end")
        time.sleep(0.01)


class HeldWrites:
    """An I/O backend (wrapping the real one) that holds every write until ``release()``: the
    blocks are sealed in their slots but no file is written. Install it through the store's
    backend factory, ``pykv.store.open_backend``; everything else passes through."""

    def __init__(self, inner) -> None:
        self.inner, self.held, self.holding, self._flush = inner, [], True, False

    def submit(self, requests) -> None:
        passed = []
        for request in requests:
            (self.held if self.holding and request.op is OpKind.WRITE else passed).append(request)
        if passed:
            self.inner.submit(passed)

    def wait(self, min_completions: int = 1, timeout: float | None = None):
        if self._flush:  # on the reactor's thread, like every other submit
            self._flush, held, self.held = False, self.held, []
            self.inner.submit(held)
        return self.inner.wait(min_completions, timeout)

    def release(self) -> None:
        """Start the held writes (and every later one) from the reactor's thread."""
        self.holding, self._flush = False, True
        self.inner.wake()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def hold_writes(monkeypatch) -> list[HeldWrites]:
    """Make every store built from now on write through a ``HeldWrites`` backend; returns them."""
    import pykv.store

    made: list[HeldWrites] = []
    real = pykv.store.open_backend

    def open_held(*args, **kwargs):
        made.append(HeldWrites(real(*args, **kwargs)))
        return made[-1]

    monkeypatch.setattr(pykv.store, "open_backend", open_held)
    return made
