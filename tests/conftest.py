"""Keep everything the suite writes inside the checkout, not in /tmp.

Each session gets ``.pytest-tmp/session-<pid>/`` under the repository: ``base/`` is pytest's
``tmp_path`` root and ``tmp/`` is ``TMPDIR`` for this process and every engine it starts (vLLM's
ZMQ sockets, torch's caches). A passing session removes its directory; a failing one keeps it
(engine logs) until the next session, which also removes directories of sessions no longer
running. An explicit ``--basetemp`` is left alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

SESSIONS = Path(__file__).resolve().parents[1] / ".pytest-tmp"
_SESSION = pytest.StashKey[Path]()
_CLEAN = pytest.StashKey[bool]()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_finished_sessions() -> None:
    for old in SESSIONS.glob("session-*"):
        pid = old.name.removeprefix("session-")
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            shutil.rmtree(old, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if config.option.basetemp is not None:
        return
    _remove_finished_sessions()
    session = SESSIONS / f"session-{os.getpid()}"
    shutil.rmtree(session, ignore_errors=True)
    (session / "tmp").mkdir(parents=True)
    config.option.basetemp = str(session / "base")
    os.environ["TMPDIR"] = str(session / "tmp")
    tempfile.tempdir = None  # re-read TMPDIR
    config.stash[_SESSION] = session


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(_SESSION, None)
    if session is None:
        return
    if config.stash.get(_CLEAN, False):
        shutil.rmtree(session, ignore_errors=True)
        if SESSIONS.exists() and not any(SESSIONS.iterdir()):
            SESSIONS.rmdir()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    clean = exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
    session.config.stash[_CLEAN] = clean
    kept = session.config.stash.get(_SESSION, None)
    if kept is not None and not clean:
        session.config.get_terminal_writer().line(f"pykv tests: work files kept in {kept}")
