"""Shared by the worker tests: wait for a worker's writes after vLLM already has the store job."""

from __future__ import annotations

import time


def settle_stores(manager, worker, keys, timeout: float = 20.0) -> None:
    """Feed the worker's reports to the manager until every key's write has ended.

    With early release a store through DRAM slots is finished for vLLM as soon as the blocks
    are in their slots; the files are written afterwards and reported in ``stores_ended``.
    Keys stored without a DRAM slot were written before their job finished: nothing to wait for.
    """
    pending = {k for k in keys if manager.dram.entry(k) is not None and k in manager.residency.writes()[0]}
    deadline = time.monotonic() + timeout
    while True:
        report = worker.take_report()
        if report:
            manager.on_worker_report(report)
        pending &= manager.residency.writes()[0]  # a reported end left ``writing`` in on_worker_report
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"writes of {len(pending)} blocks did not end")
        time.sleep(0.01)
