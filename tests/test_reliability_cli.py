"""Hostile input to every CLI command: one clear line, a non-zero exit, nothing deleted.

Each command is driven through the real CLI (``CliRunner``) with wrong paths, bad
sizes, malformed JSON (the tree marker, ``--engine-args``), a directory that is not a
tree, and, as an unprivileged user, a tree it may not read or write; ``pykv warm``
gets malformed JSONL. A test below fails when a command is added without rows here.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.tree import MARKER_NAME

from reliability.rig import NS, Rig, key_of, tree_snapshot
from reliability.system import collect, spawn
from treefactory import HOUR, set_mtime

SMALL_BENCH = ["--size", "64K", "--block-size", "64K", "--depth", "1", "--no-fio", "--no-files"]
CALIBRATE = ["calibrate", "--model", "{plain}", "--root", "{scratch}", "--no-plot"]
WARM = ["--model", "{plain}", "--root", "{scratch}"]

CASES = {  # id -> argv (placeholders filled from the ``places`` fixture)
    "inspect/missing-root": ["inspect", "{missing}"],
    "inspect/root-is-a-file": ["inspect", "{file}"],
    "inspect/not-a-tree": ["inspect", "{plain}"],
    "inspect/namespace-dir-as-root": ["inspect", "{nsdir}"],
    "inspect/malformed-marker": ["inspect", "{badmarker}"],
    "inspect/marker-of-another-version": ["inspect", "{v2marker}"],
    "inspect/unknown-option": ["inspect", "{tree}", "--max-size", "1G"],
    "gc/missing-root": ["gc", "{missing}", "--max-size", "0", "--min-age", "0"],
    "gc/root-is-a-file": ["gc", "{file}", "--max-size", "0", "--min-age", "0"],
    "gc/not-a-tree": ["gc", "{plain}", "--max-size", "0", "--min-age", "0"],
    "gc/namespace-dir-as-root": ["gc", "{nsdir}", "--max-size", "0", "--min-age", "0"],
    "gc/malformed-marker": ["gc", "{badmarker}", "--max-size", "0", "--min-age", "0"],
    "gc/size-garbage": ["gc", "{tree}", "--max-size", "12Q", "--min-age", "0"],
    "gc/size-negative": ["gc", "{tree}", "--max-size", "-1", "--min-age", "0"],
    "gc/size-empty": ["gc", "{tree}", "--max-size", "", "--min-age", "0"],
    "gc/size-missing": ["gc", "{tree}", "--min-age", "0"],
    "gc/min-age-negative": ["gc", "{tree}", "--max-size", "0", "--min-age", "-5m"],
    "fsck/missing-root": ["fsck", "{missing}", "--repair", "--grace", "0"],
    "fsck/root-is-a-file": ["fsck", "{file}", "--repair", "--grace", "0"],
    "fsck/not-a-tree": ["fsck", "{plain}", "--repair", "--grace", "0"],
    "fsck/namespace-dir-as-root": ["fsck", "{nsdir}", "--repair", "--grace", "0"],
    "fsck/malformed-marker": ["fsck", "{badmarker}", "--repair", "--grace", "0"],
    "fsck/grace-garbage": ["fsck", "{tree}", "--repair", "--grace", "soon"],
    "doctor/missing-root": ["doctor", "{missing}"],
    "doctor/root-is-a-file": ["doctor", "{file}"],
    "doctor/not-a-tree": ["doctor", "{plain}"],  # probes only in a tree or an empty directory
    "doctor/namespace-dir-as-root": ["doctor", "{nsdir}"],
    "doctor/unknown-option": ["doctor", "{tree}", "--repair"],
    "bench/missing-path": ["bench", "--path", "{missing}", *SMALL_BENCH],
    "bench/path-is-a-file": ["bench", "--path", "{file}", *SMALL_BENCH],
    "bench/size-garbage": ["bench", "--path", "{scratch}", "--size", "12Q", "--no-fio"],
    "bench/block-size-not-aligned": ["bench", "--path", "{scratch}", "--block-size", "1000", "--no-fio"],
    "bench/size-below-block-size": ["bench", "--path", "{scratch}", "--size", "4K", "--block-size", "64K"],
    "bench/depth-garbage": ["bench", "--path", "{scratch}", "--depth", "1,x", *SMALL_BENCH[:4]],
    "config/empty-root": ["config", "--root", ""],
    "config/size-garbage": ["config", "--root", "{tree}", "--dram", "12Q"],
    "config/malformed-set": ["config", "--root", "{tree}", "--set", "no-equals-sign"],
    "config/unknown-key": ["config", "--root", "{tree}", "--set", "bogus=1"],
    "config/bad-mode": ["config", "--root", "{tree}", "--set", "file_mode=999"],
    "demo/root-is-a-file": ["demo", "--root", "{file}"],
    "demo/root-not-a-tree": ["demo", "--root", "{plain}"],
    "demo/malformed-marker": ["demo", "--root", "{badmarker}"],
    "calibrate/malformed-engine-args-json": [*CALIBRATE, "--engine-args", '{"max_model_len": 4096,'],
    "calibrate/engine-args-not-an-object": [*CALIBRATE, "--engine-args", "[1, 2]"],
    "calibrate/size-garbage": [*CALIBRATE, "--bandwidth-size", "12Q"],
    "warm/missing-prompts": ["warm", "{missing}", *WARM],
    "warm/prompts-is-a-directory": ["warm", "{plain}", *WARM],
    "warm/malformed-jsonl": ["warm", "{file}", *WARM],
    "warm/empty-prompts": ["warm", "{empty}", *WARM],
    "warm/root-is-a-file": ["warm", "{prompts}", "--model", "{plain}", "--root", "{file}"],
    "warm/root-not-a-tree": ["warm", "{prompts}", "--model", "{plain}", "--root", "{plain}"],
    "warm/unknown-key": ["warm", "{prompts}", *WARM, "--set", "bogus=1"],
    "warm/malformed-engine-args-json": ["warm", "{prompts}", *WARM, "--engine-args", "{"],
    "warm/malformed-line-after-a-good-one": ["warm", "{badjsonl}", *WARM],
    "warm/line-not-an-object": ["warm", "{listjsonl}", *WARM],
    "warm/only-bad-lines-with-skip-bad": ["warm", "{allbadjsonl}", *WARM, "--skip-bad"],
    "warm/prompts-not-utf8": ["warm", "{binary}", *WARM],
    "warm/bad-set-size": ["warm", "{prompts}", *WARM, "--set", "dram_bytes=12Q"],
    "warm/bad-batch": ["warm", "{prompts}", *WARM, "--batch", "0"],
    # numbers of hundreds of digits: one line, no OverflowError, and gc creates no catalog first
    "gc/size-huge": ["gc", "{tree}", "--max-size", "9" * 400, "--min-age", "0"],
    "gc/size-huge-unit": ["gc", "{tree}", "--max-size", "1" * 300 + "G", "--min-age", "0"],
    "gc/min-age-huge": ["gc", "{tree}", "--max-size", "0", "--min-age", "9" * 400],
    "gc/min-age-huge-unit": ["gc", "{tree}", "--max-size", "0", "--min-age", "9" * 400 + "d"],
    "fsck/grace-huge": ["fsck", "{tree}", "--repair", "--grace", "9" * 400 + "h"],
    "bench/size-huge": ["bench", "--path", "{scratch}", "--size", "9" * 400, "--no-fio"],
    "config/dram-huge": ["config", "--root", "{tree}", "--dram", "9" * 400 + "G"],
    "config/staging-huge": ["config", "--root", "{tree}", "--staging", "9" * 400],
    "init/root-is-a-file": ["init", "{file}"],
    "init/malformed-marker": ["init", "{badmarker}"],
    "warm/kv-transfer-config-is-pykvs": ["warm", "{prompts}", *WARM, "--kv-transfer-config", "{}"],
    "serve/root-is-a-file": ["serve", "{plain}", "--root", "{file}"],
    "serve/root-not-a-tree": ["serve", "{plain}", "--root", "{plain}"],
    "serve/malformed-marker": ["serve", "{plain}", "--root", "{badmarker}"],
    "serve/unknown-key": ["serve", "{plain}", "--root", "{scratch}", "--set", "bogus=1"],
    "serve/size-garbage": ["serve", "{plain}", "--root", "{scratch}", "--dram", "12Q"],
    "serve/kv-transfer-config-is-pykvs": ["serve", "{plain}", "--root", "{scratch}", "--kv-transfer-config", "{}"],
    "serve/no-root": ["serve", "{plain}"],
    "completions/unknown-shell": ["completions", "show", "--shell", "tcsh"],
    "completions/unknown-action": ["completions", "remove"],
}


def fill(argv: list[str], places: dict[str, Path]) -> list[str]:
    out = []
    for arg in argv:
        for name, path in places.items():  # names are whole words in braces: no one is a prefix problem
            arg = arg.replace("{" + name + "}", str(path))
        out.append(arg)
    return out


def run(argv: list[str]):
    return CliRunner().invoke(app, argv)


@pytest.fixture
def places(tmp_path):
    """A real tree with blocks and a stale temp, a plain directory with data, a file, broken markers."""
    with Rig(tmp_path / "tree") as rig:
        rig.store([key_of(i) for i in range(4)], [rig_geometry(i) for i in range(4)])
        stale = rig.tree.temp_path(rig.path(key_of(0)))
    stale.write_bytes(b"half a block")
    set_mtime(stale, 5 * HOUR)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "data.kv").write_text("someone's data")
    (plain / "aa").mkdir()
    (tmp_path / "file").write_text("a file")
    bad = tmp_path / "badmarker"
    shutil.copytree(tmp_path / "tree", bad)
    (bad / MARKER_NAME).write_text('{"format_version": 1,')
    v2 = tmp_path / "v2marker"
    v2.mkdir()
    (v2 / MARKER_NAME).write_text(json.dumps({"format_version": 2}))
    (tmp_path / "scratch").mkdir()
    (tmp_path / "prompts.jsonl").write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "badjsonl.jsonl").write_text('{"prompt_token_ids": [1, 2, 3]}\n{"prompt": "unterminated\n')
    (tmp_path / "listjsonl.jsonl").write_text("[1, 2, 3]\n")
    (tmp_path / "allbadjsonl.jsonl").write_text('nope\n{"prompt": 5}\n')
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00prompt")
    return {"prompts": tmp_path / "prompts.jsonl", "empty": tmp_path / "empty.jsonl", "tree": tmp_path / "tree", "plain": plain, "file": tmp_path / "file", "missing": tmp_path / "missing",
            "nsdir": tmp_path / "tree" / NS.id, "badmarker": bad, "v2marker": v2, "scratch": tmp_path / "scratch",
            **{name: tmp_path / f"{name}.jsonl" for name in ("badjsonl", "listjsonl", "allbadjsonl", "binary")}}


def rig_geometry(i: int):
    from reliability.rig import geometry_of
    return geometry_of(key_of(i), 3000, 20000)


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_input_is_one_error_line_and_changes_nothing(places, tmp_path, case):
    argv = fill(CASES[case], places)
    before = tree_snapshot(tmp_path)
    result = run(argv)
    assert result.exit_code == 2, (result.exit_code, result.output)  # a user error
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("pykv: error: "), result.stderr
    assert tree_snapshot(tmp_path) == before


def test_every_command_has_hostile_input_cases():
    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    covered = {case.split("/")[0] for case in CASES}
    assert commands <= covered, f"add hostile-input cases for {sorted(commands - covered)}"


def test_errors_name_the_culprit(places):
    for case, culprit in (("gc/size-garbage", "--max-size"), ("bench/missing-path", "--path"),
                          ("gc/root-is-a-file", "not a directory"),
                          ("inspect/not-a-tree", "not a pykv tree"), ("demo/root-not-a-tree", "not a pykv tree"),
                          ("calibrate/malformed-engine-args-json", "--engine-args")):
        result = run(fill(CASES[case], places))
        assert culprit in result.stderr, (case, result.stderr)


# -- no permissions: as an unprivileged user --------------------------------------------------------

NOBODY = 65534


def as_nobody(argv: list[str]) -> tuple[int, str, str]:
    """Run the CLI in a forked child that dropped to uid/gid 65534 (modules imported beforehand)."""
    def unprivileged() -> dict:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        result = run(argv)
        return {"code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr}
    out = collect(spawn(unprivileged))
    assert "code" in out, out
    return out["code"], out["stdout"], out["stderr"]


@pytest.fixture
def shared_tmp():
    """A directory every user may traverse (pytest's own tmp dirs are private to root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user (os.setuid)")
    base = Path(tempfile.mkdtemp(prefix="pykv-perm-"))
    os.chmod(base, 0o711)
    yield base
    shutil.rmtree(base)


def warm_up(tree: Path, scratch: Path) -> None:
    """Run each command once as root so every module it imports is loaded before dropping privileges
    (the interpreter's files are not readable by nobody on the test machines)."""
    for argv in (["inspect", str(tree)], ["gc", str(tree), "--max-size", "1T", "--dry-run"], ["fsck", str(tree)],
                 ["bench", "--path", str(scratch), *SMALL_BENCH], ["config", "--root", str(tree)]):
        run(argv)
    import importlib.metadata  # noqa: F401  (click's version lookup)


@pytest.mark.parametrize("argv, mode", [
    (["inspect", "{tree}"], 0o700),  # owned by root, private: the marker cannot be read
    (["gc", "{tree}", "--max-size", "0", "--min-age", "0"], 0o700),
    (["fsck", "{tree}", "--repair", "--grace", "0"], 0o700),
    (["gc", "{tree}", "--max-size", "0", "--min-age", "0"], 0o755),  # readable, not writable
    (["fsck", "{tree}", "--repair", "--grace", "0"], 0o755),
    (["inspect", "{tree}"], "shard-000"),  # a shard directory that cannot be listed
    (["bench", "--path", "{tree}", *SMALL_BENCH], 0o755),  # cannot create its scratch directory
    (["demo", "--root", "{tree}"], 0o700),
    (["warm", "{prompts}", "--model", "{tree}", "--root", "{tree}"], 0o700),
], ids=["inspect-private", "gc-private", "fsck-private", "gc-read-only", "fsck-read-only", "inspect-unlistable",
        "bench-read-only", "demo-private", "warm-private"])
def test_no_permission_is_one_error_line_and_deletes_nothing(shared_tmp, argv, mode):
    root = shared_tmp / "tree"
    with Rig(root) as rig:
        rig.store([key_of(i) for i in range(4)], [rig_geometry(i) for i in range(4)])
        victim = rig.path(key_of(1))
        stale = rig.tree.temp_path(rig.path(key_of(2)))
    os.truncate(victim, 100)  # something for fsck --repair to quarantine
    stale.write_bytes(b"x")
    set_mtime(stale, 5 * HOUR)
    for directory, dirs, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)
    for path in [root, *root.rglob("*")]:  # stamp ages so gc would delete everything
        if path.is_file():
            os.utime(path, ns=(time.time_ns() - 2 * HOUR * 10**9, time.time_ns() - 2 * HOUR * 10**9))
    prompts = shared_tmp / "prompts.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    os.chmod(prompts, 0o644)
    warm_up(root, shared_tmp)
    if mode == "shard-000":
        os.chmod(victim.parent, 0o000)
    else:
        os.chmod(root, mode)
    before = tree_snapshot(root)
    try:
        code, stdout, stderr = as_nobody(fill(argv, {"tree": root, "prompts": prompts}))
    finally:
        os.chmod(victim.parent, 0o755)
        os.chmod(root, 0o755)
    assert code in (1, 2), (code, stdout, stderr)
    assert stderr.count("\n") == 1 and stderr.startswith("pykv: error: "), stderr
    assert "Permission denied" in stderr or "not readable" in stderr, stderr
    assert tree_snapshot(root) == before
