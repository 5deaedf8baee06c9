"""``pykv doctor`` on a mount that stalls: it answers within its time limit instead of hanging,
names the call that did not return, and says what an outage of each kind of mount does."""

from __future__ import annotations

import os
import threading
import time

import pytest
from juicefs_volume import juicefs_volume, process_tree, unavailable_reason
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.io.mounts import parse_mountinfo
from pykv.maintenance import stall_check
from pykv.maintenance.diagnosis import Verdict
from pykv.maintenance.stall_check import check_responsive, stall_behaviour

MOUNTS = """\
22 1 253:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 22 0:35 / /mnt/hard rw,relatime - nfs4 srv:/export rw,vers=4.2,hard,timeo=600
41 22 0:36 / /mnt/soft rw,relatime - nfs4 srv:/export rw,vers=4.2,soft,timeo=100
42 22 0:37 / /mnt/jfs rw,noatime - fuse.juicefs JuiceFS:vol rw,user_id=0
43 22 0:38 / /mnt/lustre rw - lustre 10.0.0.1@tcp:/fs rw
"""


def test_what_an_outage_does_is_told_per_kind_of_mount():
    local, hard, soft, fuse, lustre = (stall_behaviour(m) for m in parse_mountinfo(MOUNTS))
    assert local.verdict is Verdict.OK and "local" in local.detail
    assert hard.verdict is Verdict.WARN and "hard NFS" in hard.detail and "io_deadline" in hard.detail
    assert soft.verdict is Verdict.OK and "timeo=100" in soft.detail
    assert fuse.verdict is Verdict.WARN and "FUSE daemon" in fuse.detail
    assert lustre.verdict is Verdict.WARN
    assert stall_behaviour(None).verdict is Verdict.SKIP


def test_a_mount_whose_lookups_hang_fails_within_the_time_limit(tmp_path, monkeypatch):
    gate = threading.Event()
    real = os.lstat

    def hanging(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            gate.wait(30)
        return real(path, *args, **kwargs)
    monkeypatch.setattr(stall_check.os, "lstat", hanging)
    began = time.monotonic()
    diagnosis = check_responsive(tmp_path, timeout=0.5)
    assert time.monotonic() - began < 1.5
    assert diagnosis.verdict is Verdict.FAIL and "lstat of a block name did not answer within" in diagnosis.detail
    gate.set()


def test_slow_lookups_are_a_warning_and_fast_ones_are_measured(tmp_path, monkeypatch):
    assert check_responsive(tmp_path).verdict is Verdict.OK
    assert "lookups of absent block names: median" in check_responsive(tmp_path).detail
    real = os.lstat
    monkeypatch.setattr(stall_check.os, "lstat", lambda p, *a, **k: (time.sleep(0.3), real(p, *a, **k))[1])
    monkeypatch.setattr(stall_check, "LOOKUP_SAMPLES", 3)
    slow = check_responsive(tmp_path)
    assert slow.verdict is Verdict.WARN and "lookup_deadline" in slow.detail


@pytest.mark.slow
def test_doctor_on_a_stopped_fuse_daemon_answers_instead_of_hanging(tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with juicefs_volume(tmp_path / "jfs", clients=1) as volume:
        root = volume.mounts[0] / "tree"
        root.mkdir()
        assert CliRunner().invoke(app, ["init", str(root)]).exit_code == 0
        healthy = CliRunner().invoke(app, ["doctor", str(root)])
        assert "stall_behaviour" in healthy.output and "FUSE daemon" in healthy.output, healthy.output
        pids = process_tree(volume.pids[0])
        time.sleep(1.5)  # the kernel's cached names and attributes (1 s) expire
        for pid in pids:
            os.kill(pid, 19)  # SIGSTOP
        try:
            began = time.monotonic()
            stalled = CliRunner().invoke(app, ["doctor", str(root)])
            took = time.monotonic() - began
        finally:
            for pid in pids:
                os.kill(pid, 18)  # SIGCONT
        assert took < stall_check.RESPONSE_TIMEOUT_S + 5
        assert stalled.exit_code == 1, stalled.output
        assert "did not answer within" in stalled.output
