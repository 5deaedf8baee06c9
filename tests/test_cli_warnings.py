"""What the commands print about a hostile or read-only tree: a library warning (gc, the catalog)
is one ``pykv: warning:`` line with the path's control characters escaped; a block gc may not
delete on a read-only mount is said to be that, not junk; ``inspect --json`` is strict JSON
(a NaN or an infinity in a tree's metadata comes out as null)."""

from __future__ import annotations

import json
import logging
import os

from mounts import bind  # noqa: F401  (fixture)
from treefactory import NS, add_block, key, make_tree
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.maintenance.catalog import CATALOG_NAME


def run(*args):
    """The command as under ``pykv`` itself: no handler on the root logger (pytest's capture adds one)."""
    handlers, logging.root.handlers = logging.root.handlers, []
    try:
        return CliRunner().invoke(app, [str(a) for a in args])
    finally:
        logging.root.handlers = handlers


def test_gc_on_a_read_only_mount_says_the_blocks_could_not_be_deleted(tmp_path, bind):
    source = make_tree(tmp_path / "src")
    for i in range(3):
        add_block(source, bytes([i * 60]) + key(i))
    mount = bind(source.root, tmp_path / "ro", read_only=True)
    result = run("gc", mount, "--max-size", "0", "--min-age", "0s", "--no-catalog")
    assert "Traceback" not in result.output
    assert "3 blocks (" in result.stdout and "could not be deleted" in result.stdout, result.output
    assert "not blocks pykv wrote" not in result.stdout
    warnings = [line for line in result.stderr.splitlines() if "cannot delete" in line]
    assert len(warnings) == 3 and all(line.startswith("pykv: warning: gc: cannot delete ") for line in warnings)
    summary = json.loads(run("gc", mount, "--max-size", "0", "--min-age", "0s", "--no-catalog", "--json").stdout)
    assert summary["undeleted_files"] == 3 and summary["junk_files"] == 0 and summary["freed_files"] == 0


def test_a_warning_naming_a_hostile_path_is_one_escaped_line(tmp_path):
    root = tmp_path / "evil\x1b[31mred\nname"
    root.mkdir()
    tree = make_tree(root)
    add_block(tree, key(1))
    tree.state_dir.mkdir(exist_ok=True)
    (tree.state_dir / CATALOG_NAME).write_bytes(b"not a database" * 100)  # the catalog warning names the path
    result = run("inspect", tree.root)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if "catalog" in line]
    assert len(lines) == 1 and lines[0].startswith("pykv: warning: catalog ")
    assert "\x1b" not in result.stderr and "\\x1b[31mred" in lines[0]


def test_inspect_json_is_strict_json_whatever_the_metadata_holds(tmp_path):
    tree = make_tree(tmp_path)
    add_block(tree, key(1))
    (tree.root / NS.id / "namespace.json").write_text('{"model": NaN, "dtype": Infinity, "tokens_per_block": -Infinity}')
    result = run("inspect", "--json", tree.root)
    assert result.exit_code == 0, result.output

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    json.loads(result.stdout, parse_constant=refuse)
    assert "NaN" not in result.stdout and "Infinity" not in result.stdout
    assert os.path.exists(tree.root / NS.id / "namespace.json")  # read, never rewritten


def test_another_librarys_warning_is_not_called_pykvs(capsys):
    """Only records of pykv's loggers get the ``pykv:`` prefix; vLLM's or torch's go to the handler
    that was the last resort before, as they did."""
    from pykv.commands import output
    seen = []

    class Previous(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    def record(name, level, message, *args):
        return logging.LogRecord(name, level, __file__, 1, message, args, None)
    handler = output.VisibleWarnings(Previous(logging.WARNING))
    handler.handle(record("torch.cuda", logging.ERROR, "CUDA error: out of memory"))
    handler.handle(record("pykvish", logging.WARNING, "not pykv's either"))
    handler.handle(record("pykv.maintenance.gc", logging.WARNING, "gc: cannot delete %s", "a\x1bb"))
    assert seen == ["CUDA error: out of memory", "not pykv's either"]
    assert capsys.readouterr().err == "pykv: warning: gc: cannot delete a\\x1bb\n"
