"""The one progress protocol between a job's engine process and its caller: JSON lines.

The engine process appends one JSON object per line to its events file (``EventLog``);
the caller reads the complete lines as they appear (``EventReader``). Every event has
an ``event`` name:

- ``progress``: ``phase``, ``done``, ``total`` (what a progress bar shows);
- a job's own events (calibrate's ``started``, ``sample``, ``settled``);
- ``result``: the job's outcome (``data``, a JSON object); the last event of a job that worked;
- ``error``: a user error the engine side found once its engine was up (``message``);
  the caller raises it as ``InputError``.

A job that ends without ``result`` or ``error`` failed; the runner says so, naming its log.
This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

from pykv.errors import PykvError

PROGRESS, RESULT, ERROR = "progress", "result", "error"
TERMINAL = (RESULT, ERROR)
MAX_LINE_BYTES = 1 << 20
"""A longer line is not an event (the reader stops there rather than allocate for it)."""


class EventLog:
    """The engine side: append events to ``path``, one line each, flushed at once."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._file = open(path, "a", buffering=1, encoding="utf-8")

    def emit(self, event: str, **fields: Any) -> None:
        self._file.write(json.dumps({"event": event, **fields}) + "\n")
        self._file.flush()

    def progress(self, phase: str, done: int, total: int) -> None:
        self.emit(PROGRESS, phase=phase, done=done, total=total)

    def close(self) -> None:
        self._file.close()


class EventReader:
    """The caller side: the complete events appended since the last ``read``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(MAX_LINE_BYTES * 4)
        except FileNotFoundError:
            return []
        complete = data[:data.rfind(b"\n") + 1]
        self._offset += len(complete)
        events = []
        for line in complete.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # not an event: the engine's own writes never produce one
            if isinstance(event, dict) and isinstance(event.get("event"), str):
                events.append(event)
        return events


JobFunction = Callable[[dict[str, Any], EventLog], dict[str, Any]]
"""``job(plan, events) -> result``: the engine side of a job."""


def engine_main(job: JobFunction, argv: list[str] | None = None) -> NoReturn:
    """Run ``job`` as ``python -m MODULE PLAN.json EVENTS.jsonl`` (what the runner starts).

    Its result is the ``result`` event; a ``PykvError`` (the user's mistake, found once the
    engine is up) the ``error`` event. Ends with ``os._exit``: vLLM's threads tear down slowly
    (the job stops its engine itself, ``compat.shutdown_engine``)."""
    plan_path, events_path = (argv if argv is not None else sys.argv[1:])[:2]
    plan = json.loads(Path(plan_path).read_text())
    events = EventLog(events_path)
    try:
        result = job(plan, events)
    except PykvError as exc:
        events.emit(ERROR, message=str(exc))
    else:
        events.emit(RESULT, data=result)
    events.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
