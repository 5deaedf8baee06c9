"""``pykv/jobs/runner.py`` and ``pykv/jobs/progress.py``: one engine process per job, its events, its failures.

The engine process is a shell script standing in for ``python -m MODULE PLAN EVENTS``
($3 = the plan, $4 = the events file), so these tests need no vLLM.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pykv.errors import InputError
from pykv.jobs.progress import EventLog, EventReader
from pykv.jobs.runner import EngineJob, JobFailed, JobFailure, last_error


def fake_python(tmp_path: Path, body: str) -> str:
    script = tmp_path / "fake-python"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return str(script)


def event(**fields) -> str:
    return f"echo '{json.dumps(fields)}' >> \"$4\"\n"


def is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def job(tmp_path: Path, body: str, **kwargs) -> EngineJob:
    return EngineJob("test", "pykv.jobs.nothing", {"x": 1}, tmp_path, env=dict(os.environ),
                     python=fake_python(tmp_path, body), **kwargs)


def test_progress_goes_to_the_callback_own_events_are_yielded_and_the_result_returned(tmp_path):
    body = ('[ "$(cat "$3")" = \'{"x": 1}\' ] || exit 9\n'  # the plan reached the engine
            + event(event="progress", phase="plan", done=1, total=2) + event(event="started", seconds=1)
            + event(event="result", data={"answer": 42}))
    seen: list = []
    j = job(tmp_path, body)
    own = list(j.events(lambda *p: seen.append(p)))
    assert seen == [("plan", 1, 2)] and own == [{"event": "started", "seconds": 1}]
    assert j.result == {"answer": 42}
    assert job(tmp_path, body).run() == {"answer": 42}


def test_a_user_error_of_the_engine_side_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="^line 3: a text prompt needs a tokenizer$"):
        job(tmp_path, event(event="error", message="line 3: a text prompt needs a tokenizer")).run()


def test_a_failed_engine_names_its_exit_status_cause_and_log_and_its_helpers_are_stopped(tmp_path):
    orphan = tmp_path / "orphan.pid"
    body = (f"sleep 600 & echo $! > {orphan}\n"
            "echo 'ValueError: the model is too large'\necho 'RuntimeError: Engine core initialization failed'\n"
            "exit 3\n")
    with pytest.raises(JobFailed) as info:
        job(tmp_path, body).run()
    failed = info.value
    assert failed.failure is JobFailure.EXITED and failed.exit_code == 3 and failed.log == tmp_path / "test.log"
    assert str(failed) == f"the test engine failed (exit 3): ValueError: the model is too large; its log is {failed.log}"
    assert not is_running(int(orphan.read_text()))


def test_exit_zero_without_a_result_is_a_failure(tmp_path):
    with pytest.raises(JobFailed) as info:
        job(tmp_path, "echo 'all good, honestly'\n").run()
    assert info.value.failure is JobFailure.NO_RESULT and "all good, honestly" in str(info.value)


def test_a_job_past_its_deadline_is_stopped_with_its_whole_group(tmp_path):
    pid = tmp_path / "engine.pid"
    with pytest.raises(JobFailed) as info:
        job(tmp_path, f"echo $$ > {pid}\nsleep 600 &\nexec sleep 600\n", deadline=0.5).run()
    assert info.value.failure is JobFailure.TIMED_OUT and "did not finish within" in str(info.value)
    assert not is_running(int(pid.read_text()))


def test_an_interrupted_caller_stops_the_engine(tmp_path):
    pid = tmp_path / "engine.pid"

    def interrupt(phase, done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        job(tmp_path, f"echo $$ > {pid}\n" + event(event="progress", phase="p", done=0, total=1)
            + "exec sleep 600\n").run(interrupt)
    assert not is_running(int(pid.read_text()))


def test_the_reader_returns_complete_lines_once_and_skips_what_is_not_an_event(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventReader(path)
    assert reader.read() == []  # not there yet
    log = EventLog(path)
    log.progress("plan", 0, 3)
    with open(path, "a") as f:
        f.write('not json\n[1, 2]\n{"no": "event"}\n{"event": "sample", "sec')  # the last one is half written
    assert reader.read() == [{"event": "progress", "phase": "plan", "done": 0, "total": 3}]
    with open(path, "a") as f:
        f.write('onds": 1}\n')
    assert reader.read() == [{"event": "sample", "seconds": 1}]
    assert reader.read() == []
    log.close()


def test_last_error_prefers_the_specific_exception_then_the_last_line(tmp_path):
    log = tmp_path / "log"
    log.write_text("(Worker) ERROR x.py:9] ValueError: bad\nRuntimeError: Engine core initialization failed\n")
    assert last_error(log) == "ValueError: bad"
    log.write_text("starting\nKilled\n\n")
    assert last_error(log) == "Killed"
    assert last_error(tmp_path / "missing") == ""


def test_runner_and_protocol_import_neither_vllm_nor_torch():
    import subprocess
    code = ("import sys, pykv.jobs.runner, pykv.jobs.progress, pykv.jobs.calibrate, pykv.jobs.warm, pykv.jobs.demo; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_the_engine_imports_the_installed_pykv_whatever_the_current_directory_holds(tmp_path, monkeypatch):
    """A folder named ``pykv`` where the command runs (the clone's parent, say) must not shadow the
    installed package in the engine process: ``python -m`` puts the current directory first on
    ``sys.path`` unless ``PYTHONSAFEPATH`` is set."""
    import pykv
    shadow = tmp_path / "cwd" / "pykv" / "jobs"
    shadow.mkdir(parents=True)
    (shadow.parent / "__init__.py").write_text("raise ImportError('the shadow pykv was imported')\n")
    (shadow / "__init__.py").write_text("")
    (shadow / "nothing.py").write_text("raise SystemExit(7)\n")
    monkeypatch.chdir(tmp_path / "cwd")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    work = tmp_path / "work"
    work.mkdir()
    j = EngineJob("shadow", "pykv.jobs.progress", {"x": 1}, work, env=env, python=sys.executable)
    with pytest.raises(JobFailed) as failure:
        j.run()  # pykv.jobs.progress as a script does nothing: the job ends without a result
    log = j.log.read_text()
    assert "shadow pykv" not in log and failure.value.exit_code == 0, log  # ran the installed module
    assert Path(pykv.__file__).parent != shadow.parent
