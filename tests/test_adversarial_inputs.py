"""Adversarial tests for files pykv reads besides blocks (docs/adversarial-matrix.md): state files
in ``.pykv`` nested past Python's stack, the inputs an engine or ``pykv warm`` reads, and the
promise that nothing is ever unpickled, checked by a scan that sees through import aliases.
"""

from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pykv.auth import KeyFileError, load_key_ring, write_key_file
from pykv.calibration.file import CalibrationError
from pykv.calibration.gate import BreakEvenGate
from pykv.commands.app import app
from pykv.errors import InputError, MembershipError
from pykv.jobs.warm import read_prompts
from pykv.maintenance.gc import last_gc
from pykv.maintenance.lease import StateFault, check_lease
from pykv.membership import read_record
from pykv.tree import EVICT_RECORD_NAME, GC_STATE_NAME, LEASE_NAME, SET_NAME, KVTree

from reliability.deadline import deadline

REPO = Path(__file__).resolve().parents[1]
DEEP = "[" * 4000  # within every state file's size limit, past Python's recursion limit
ENGINE = {"model": "m", "dtype": "bfloat16", "kv_layout": "NHD"}


def run(*argv: object):
    with deadline(30):
        return CliRunner().invoke(app, [str(a) for a in argv])


def one_error_line(result, naming: str) -> bool:
    return (result.exit_code == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("pykv: error: ")
            and naming in result.stderr and "Traceback" not in result.output)


def tree_with_state(root: Path, name: str, content: str) -> KVTree:
    tree = KVTree.create(root)
    tree.ensure_state_dir()
    (tree.state_dir / name).write_text(content)
    return tree


# -- state files nested past the stack ------------------------------------------------------------
def test_a_lease_nested_past_the_stack_is_a_defect_fsck_moves(tmp_path):
    tree = tree_with_state(tmp_path / "tree", LEASE_NAME, DEEP)
    defect = check_lease(tree, time.time())
    assert defect is not None and defect.fault is StateFault.UNPARSABLE
    result = run("fsck", tree.root, "--repair", "--grace", "0")
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert not os.path.lexists(tree.state_dir / LEASE_NAME)
    assert [p.name for p in (tree.state_dir / "quarantine").rglob(LEASE_NAME)] == [LEASE_NAME]


def test_an_eviction_record_nested_past_the_stack_is_unreadable_not_a_crash(tmp_path):
    tree = tree_with_state(tmp_path / "tree", EVICT_RECORD_NAME, DEEP)
    for command in (["inspect", tree.root], ["doctor", tree.root]):
        result = run(*command)
        assert "Traceback" not in result.output and "unreadable eviction record" in result.output, result.output


def test_a_set_record_nested_past_the_stack_is_one_line(tmp_path):
    a = tree_with_state(tmp_path / "a", SET_NAME, DEEP)
    KVTree.create(tmp_path / "b")
    with pytest.raises(MembershipError, match="unreadable device set record"):
        read_record(a)
    result = run("inspect", tmp_path / "a", tmp_path / "b")
    assert one_error_line(result, f"{SET_NAME}: unreadable device set record"), result.output


def test_a_gc_record_nested_past_the_stack_is_no_record(tmp_path):
    tree = tree_with_state(tmp_path / "tree", GC_STATE_NAME, DEEP)
    assert last_gc(tree) is None
    result = run("inspect", tree.root)
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert run("gc", tree.root, "--max-size", "1G").exit_code == 0  # gc.json is pykv's: replaced


# -- what pykv warm and an engine read besides the tree --------------------------------------------
def test_a_prompt_line_nested_past_the_stack_is_a_bad_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "x"}\n{"prompt_token_ids": ' + DEEP + "\n")
    with pytest.raises(InputError, match=":2: "):
        read_prompts(prompts)


def test_warm_names_a_prompt_line_nested_past_the_stack_in_one_line(tmp_path):
    root = tmp_path / "tree"
    KVTree.create(root)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(DEEP + "\n")
    result = run("warm", prompts, "--model", tmp_path / "no-model", "--root", root)
    assert one_error_line(result, f"{prompts}:1: "), result.output


def test_a_breakeven_file_nested_past_the_stack_is_a_calibration_error(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(DEEP)
    with pytest.raises(CalibrationError):
        BreakEvenGate.from_file(path, ENGINE, setting="breakeven_file")


def test_a_breakeven_file_that_is_a_fifo_never_blocks_the_engine(tmp_path):
    path = tmp_path / "calibration.json"
    os.mkfifo(path)
    started = time.monotonic()
    with deadline(5), pytest.raises(CalibrationError):  # (the deadline's TimeoutError is an OSError: load
        BreakEvenGate.from_file(path, ENGINE, setting="breakeven_file")  # turns it into a CalibrationError)
    assert time.monotonic() - started < 4


def test_a_breakeven_file_linked_to_an_endless_device_is_refused_unread(tmp_path):
    path = tmp_path / "calibration.json"
    path.symlink_to("/dev/zero")
    with deadline(5), pytest.raises(CalibrationError, match="cannot read"):
        BreakEvenGate.from_file(path, ENGINE, setting="breakeven_file")


# -- nothing is ever unpickled: a scan that sees through aliases -----------------------------------
UNPICKLERS = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "joblib", "cloudpickle", "yaml",
              "copyreg", "jsonpickle"}
LOADERS = {"torch.load", "torch.serialization.load", "torch.jit.load", "pandas.read_pickle",
           "numpy.lib.format.read_array", "builtins.eval", "builtins.exec"}
# (importlib.import_module is left out: pykv.selfcheck imports pykv's own modules by name, never a name from a file)


def _deserializers(tree: ast.AST) -> list[str]:
    """Imports of unpicklers and calls of code loaders, resolving ``import x as y`` and
    ``from x import y as z`` (``t.load`` after ``import torch as t``; ``load`` after
    ``from torch import load``), plus ``eval``, ``exec``, ``__import__`` and ``np.load`` with pickles."""
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
                if alias.name.split(".")[0] in UNPICKLERS:
                    found.append(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in UNPICKLERS:
                found.append(node.module)
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        head, _, rest = name.partition(".")
        full = aliases.get(head, head) + (f".{rest}" if rest else "")
        full = full.replace("np.", "numpy.", 1) if full.startswith("np.") else full
        if full in LOADERS or name in ("eval", "exec", "__import__"):
            found.append(full)
        if full == "numpy.load" and any(k.arg == "allow_pickle" and not (
                isinstance(k.value, ast.Constant) and k.value.value is False) for k in node.keywords):
            found.append("numpy.load(allow_pickle=...)")
    return found


def test_the_alias_aware_scan_catches_what_a_name_scan_misses():
    code = ("import torch as t\nfrom torch import load as l\nimport pandas as pd\n"
            "import numpy as n\nfrom copyreg import pickle\n"
            "t.load(f)\nl(f)\nt.jit.load(f)\npd.read_pickle(f)\n"
            "n.load(f, allow_pickle=True)\nn.load(f)\n")
    assert _deserializers(ast.parse(code)) == ["copyreg", "torch.load", "torch.load", "torch.jit.load",
                                               "pandas.read_pickle", "numpy.load(allow_pickle=...)"]


def test_no_deserializer_of_code_under_any_alias_anywhere_in_pykv():
    sources = list((REPO / "pykv").rglob("*.py"))
    assert len(sources) > 30
    offenders = {str(p.relative_to(REPO)): found for p in sources
                 if (found := _deserializers(ast.parse(p.read_text(), filename=str(p))))}
    assert offenders == {}


# -- the key file: anything but a small private regular file --------------------------------------
def _key_file_kinds(path: Path, kind: str, tmp_path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "device":
        os.symlink("/dev/zero", path)  # a link to a device: followed (the path is configuration), then refused
    elif kind == "sparse-terabyte":
        with open(path, "wb") as f:
            f.truncate(1 << 40)
        os.chmod(path, 0o600)
    elif kind == "link-to-a-readable-file":
        readable = tmp_path / "readable"
        write_key_file(readable, {"k1": bytes(range(32))})
        os.chmod(readable, 0o644)
        os.symlink(readable, path)
    elif kind == "not-utf8":
        path.write_bytes(b"k1 \xff\xfe" + b"0" * 62 + b"\n")
        os.chmod(path, 0o600)


@pytest.mark.parametrize("kind", ["fifo", "device", "sparse-terabyte", "link-to-a-readable-file", "not-utf8"])
def test_a_key_file_that_is_no_small_private_file_is_one_line_at_once(tmp_path, kind):
    path = tmp_path / "keys"
    _key_file_kinds(path, kind, tmp_path)
    with deadline(5), pytest.raises(KeyFileError) as raised:
        load_key_ring(path)
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)
    tree = KVTree.create(tmp_path / "tree")
    result = run("fsck", tree.root, "--key-file", path)
    assert one_error_line(result, str(path)), result.output
