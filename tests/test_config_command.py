"""``pykv config`` prints a --kv-transfer-config that PykvConfig reads back unchanged."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.config import PykvConfig
from pykv.errors import PykvError


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_config_round_trips_through_pykv_config(tmp_path):
    (tmp_path / "kv").mkdir()
    result = run("config", "--root", str(tmp_path / "kv"), "--dram", "16G", "--dram-policy", "arc", "--io-depth", "8",
                 "--set", "open_ahead=4", "--block-tokens", "512")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kv_connector"] == "PykvOffloadingConnector"
    assert data["kv_load_failure_policy"] == "recompute"  # failed loads recompute, never error
    extra = data["kv_connector_extra_config"]
    assert extra["block_size"] == 512 and extra["spec_name"] == "PykvSpec"
    config = PykvConfig.from_extra_config(extra)
    assert (config.root, config.dram_bytes, config.dram_policy, config.io_depth, config.open_ahead) == \
        (str(tmp_path / "kv"), 16 << 30, "arc", 8, 4)


def test_config_rejects_unknown_keys_and_bad_values_in_one_line(tmp_path):
    for args, needle in ((["--set", "bogus=1"], "kv_connector_extra_config.bogus: unknown key"),
                         (["--dram", "12Q"], "kv_connector_extra_config.dram_bytes: cannot parse size"),
                         (["--set", "novalue"], "--set: expected KEY=VALUE")):
        result = run("config", "--root", str(tmp_path), *args)
        assert result.exit_code == 2 and result.stdout == ""
        assert result.stderr.startswith("pykv: error: ") and needle in result.stderr
        assert result.stderr.count("\n") == 1


def test_config_requires_root():
    result = run("config")
    assert result.exit_code == 2 and "--root" in result.stderr


def test_set_reads_values_as_text_for_every_command_alike(tmp_path):
    """One KEY=VALUE parser: ``--set file_mode=600`` is the octal mode 0600 in `pykv config` and
    `pykv serve` alike (read as JSON it was the decimal 600, refused as outside 0000..0777)."""
    (tmp_path / "t").mkdir()
    config = run("config", "--root", str(tmp_path / "t"), "--set", "file_mode=600", "--set", "store=false")
    assert config.exit_code == 0, config.output
    extra = json.loads(config.stdout)["kv_connector_extra_config"]
    assert extra["file_mode"] == "0600" and extra["store"] is False
    serve = run("serve", "/models/m", "--root", str(tmp_path / "t"), "--set", "file_mode=600", "--set",
                "store=false", "--dry-run")
    assert serve.exit_code == 0, serve.output
    served = json.loads(serve.stdout.split("--kv-transfer-config ", 1)[1].split("'")[1])
    assert {k: served["kv_connector_extra_config"][k] for k in ("file_mode", "store")} == {"file_mode": "0600",
                                                                                          "store": False}


def roots_of(result) -> list[str]:
    assert result.exit_code == 0, result.output
    extra = json.loads(result.stdout)["kv_connector_extra_config"]
    return extra["roots"] if "roots" in extra else [extra["root"]]


def refusal(result) -> str:
    """The one error line of a refused run (exit 2, nothing on stdout)."""
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr.startswith("pykv: error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def devices(tmp_path, count):
    paths = [tmp_path / f"dev{i}" for i in range(count)]
    for path in paths:
        path.mkdir()
    return [str(path) for path in paths]


def test_roots_takes_several_directories_and_mixes_with_root(tmp_path):
    a, b, c, d = devices(tmp_path, 4)
    assert roots_of(run("config", "--roots", a, b, c)) == [a, b, c]
    assert roots_of(run("config", "--roots", a, b, c, "--dram", "1G")) == [a, b, c]
    assert roots_of(run("config", "--root", a, "--roots", b, c, "--root", d)) == [a, b, c, d]
    assert roots_of(run("config", "--roots=" + a, b)) == [a, b]
    assert roots_of(run("config", "--roots", a)) == [a]


def test_a_stray_argument_without_roots_is_refused(tmp_path):
    a, b = devices(tmp_path, 2)
    assert "unexpected extra argument" in refusal(run("config", "--root", a, b))


def test_a_relative_root_is_printed_absolute(tmp_path, monkeypatch):
    devices(tmp_path, 2)
    monkeypatch.chdir(tmp_path)
    assert roots_of(run("config", "--root", "dev0")) == [str(tmp_path / "dev0")]
    assert roots_of(run("config", "--roots", "dev0", "./dev1")) == [str(tmp_path / "dev0"), str(tmp_path / "dev1")]


def bad_root(tmp_path, layout):
    """A root that no engine may use, by kind: what it is and the words its refusal must hold."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "thesis.tex").write_text("the user's")
    return {"missing": (tmp_path / "kv", "does not exist; create it with `pykv init"),
            "missing-parent": (tmp_path / "no" / "kv", "does not exist; create it with `pykv init"),
            "file": (tmp_path / "file", "is not a directory"),
            "under-a-file": (tmp_path / "file" / "kv", "is not a directory (a component of its path is a file)"),
            "symlink-loop": (tmp_path / "loop", "a loop of symbolic links"),
            "dangling-link": (tmp_path / "dangling", "symbolic link to nothing"),
            "holds-files": (tmp_path / "full", "is not a pykv tree")}[layout]


LAYOUTS = ["missing", "missing-parent", "file", "under-a-file", "symlink-loop", "dangling-link", "holds-files"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_root_no_engine_may_use_is_one_line_and_nothing_is_made(tmp_path, layout):
    root, words = bad_root(tmp_path, layout)
    good = devices(tmp_path, 1)[0]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for args, field in ((["--root", root], "--root: "), (["--roots", good, root], "--root[1]: ")):
        message = refusal(run("config", *args))
        assert message.startswith(f"pykv: error: {field}{root} ") and words in message
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("layout", LAYOUTS)
def test_config_refuses_exactly_what_the_engine_refuses(tmp_path, layout):
    """``pykv config`` runs the engine's own check (``check_roots``): the same reason, another field name."""
    from pykv.config import PykvConfig
    from pykv.store import open_devices
    root, _ = bad_root(tmp_path, layout)
    with pytest.raises(PykvError) as engine:
        open_devices(PykvConfig.from_extra_config({"root": str(root)}))
    field, reason = str(engine.value).split(": ", 1)
    assert field == "kv_connector_extra_config.root"
    assert refusal(run("config", "--root", root)) == f"pykv: error: --root: {reason}\n"
    assert not (tmp_path / "kv").exists() and not (tmp_path / "no").exists()


def test_a_root_that_exists_and_is_empty_or_a_tree_is_accepted_without_a_change(tmp_path):
    (tmp_path / "empty").mkdir()
    assert roots_of(run("config", "--root", tmp_path / "empty")) == [str(tmp_path / "empty")]
    assert list((tmp_path / "empty").iterdir()) == []  # config writes no marker
    assert run("init", tmp_path / "tree").exit_code == 0
    assert roots_of(run("config", "--root", tmp_path / "tree")) == [str(tmp_path / "tree")]


# -- sizes ----------------------------------------------------------------------------------------
def dram_of(result) -> int:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["kv_connector_extra_config"]["dram_bytes"]


def test_sizes_accept_every_spelling_of_a_binary_unit_and_a_bare_number_is_bytes(tmp_path):
    for text in ("16GB", "16G", "16 G", "16gib", "16 GiB"):
        assert dram_of(run("config", "--root", tmp_path, "--dram", text)) == 16 << 30
    assert dram_of(run("config", "--root", tmp_path, "--dram", "16")) == 16
    assert dram_of(run("config", "--root", tmp_path, "--set", "dram_bytes=1.5G")) == 3 << 29


@pytest.mark.parametrize("args, message", [
    (["--dram", "16", "GB"], "--dram: '16 GB' is split in two arguments; write 16GB"),
    (["--dram", "16", "G"], "--dram: '16 G' is split in two arguments; write 16G"),
    (["--dram=16", "gib"], "--dram: '16 gib' is split in two arguments; write 16gib"),
    (["--staging", "2", "MiB"], "--staging: '2 MiB' is split in two arguments; write 2MiB"),
    (["--set", "dram_bytes=16", "GB"], "--set dram_bytes: '16 GB' is split in two arguments; write dram_bytes=16GB"),
    (["--set", "max-tree-bytes=1", "T"], "--set max_tree_bytes: '1 T' is split in two arguments; write "
                                         "max_tree_bytes=1T"),
])
def test_a_size_split_in_two_arguments_is_one_line(tmp_path, args, message):
    assert refusal(run("config", "--root", tmp_path, *args)) == f"pykv: error: {message}\n"


@pytest.mark.parametrize("value", ["16X", "16 GBs", "16GBs", "1e3G", "-1G", "G", "9" * 400 + "G", "9" * 5000])
def test_a_size_that_does_not_parse_is_one_line_naming_the_key(tmp_path, value):
    message = refusal(run("config", "--root", tmp_path, "--dram", value))
    assert message.startswith("pykv: error: kv_connector_extra_config.dram_bytes: ") and len(message) < 300
