"""``PykvCommand``: the raw arguments every pykv command checks before click parses them
(``pykv/commands/command.py``): sizes split in two, empty directories, ``--roots A B``."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.commands.command import SIZE_KEYS, expand_several, refuse_split_sizes
from pykv.errors import InputError


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def refusal(result) -> str:
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr.startswith("pykv: error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr.removeprefix("pykv: error: ").rstrip("\n")


@pytest.mark.parametrize("args, expanded", [
    (["--roots", "a", "b", "c"], ["--roots", "a", "--roots", "b", "--roots", "c"]),
    (["--roots=a", "b", "--dram", "1G"], ["--roots=a", "--roots", "b", "--dram", "1G"]),
    (["m", "--roots", "a", "--port", "1", "x"], ["m", "--roots", "a", "--port", "1", "x"]),
    (["--roots", "-odd", "b"], ["--roots", "-odd", "--roots", "b"]),  # the first value is taken as it is
    (["--root", "a", "b"], ["--root", "a", "b"]),  # --root takes one
    (["--", "--roots", "a", "b"], ["--", "--roots", "a", "b"]),
])
def test_roots_takes_the_arguments_up_to_the_next_option(args, expanded):
    assert expand_several(args, ["--roots"]) == expanded


def test_the_size_keys_are_the_configs_sizes():
    assert SIZE_KEYS == {"staging_bytes", "read_segment_bytes", "dram_bytes", "preload_max_bytes", "max_tree_bytes",
                         "codec_chunk"}


@pytest.mark.parametrize("args", [["--dram", "16G", "GB"], ["--dram", "16", "--port", "8000"], ["--dram", "16"],
                                  ["--dram", "16", "GBs"], ["--dram", "16", "X"], ["--set", "io_depth=16", "G"],
                                  ["--set", "dram_bytes", "G"], ["--port", "16", "G"], ["--", "--dram", "16", "G"],
                                  ["--dram", "auto", "G"]])
def test_what_is_not_a_split_size_passes(args):
    refuse_split_sizes(args, {"--dram"}, settings=True)


def test_set_is_checked_only_where_the_command_has_it():
    refuse_split_sizes(["--set", "dram_bytes=1", "G"], set(), settings=False)
    with pytest.raises(InputError, match="^--set dram_bytes: '1 G' is split"):
        refuse_split_sizes(["--set", "dram_bytes=1", "G"], set(), settings=True)


@pytest.mark.parametrize("args, message", [
    (["gc", "ROOT", "--max-size", "500", "G"], "--max-size: '500 G' is split in two arguments; write 500G"),
    (["bench", "--size", "4", "GiB"], "--size: '4 GiB' is split in two arguments; write 4GiB"),
    (["bench", "--block-size", "28", "M"], "--block-size: '28 M' is split in two arguments; write 28M"),
    (["calibrate", "--model", "m", "--root", "ROOT", "--dram-bytes", "4", "G"],
     "--dram-bytes: '4 G' is split in two arguments; write 4G"),
    (["calibrate", "--model", "m", "--root", "ROOT", "--bandwidth-size=1", "gb"],
     "--bandwidth-size: '1 gb' is split in two arguments; write 1gb"),
    (["warm", "PROMPTS", "--model", "m", "--root", "ROOT", "--set", "dram_bytes=2", "G", "--block-size", "16"],
     "--set dram_bytes: '2 G' is split in two arguments; write dram_bytes=2G"),
])
def test_every_command_refuses_a_size_split_in_two(tmp_path, args, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2]}\n')
    filled = [str(tmp_path) if a == "ROOT" else str(prompts) if a == "PROMPTS" else a for a in args]
    assert refusal(run(*filled)) == message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


@pytest.mark.parametrize("args", [["config", "--root", ""], ["serve", "m", "--root=", "--dry-run"],
                                  ["warm", "p.jsonl", "--model", "m", "--roots", " "], ["bench", "--path", ""]])
def test_an_empty_directory_option_is_not_the_current_directory(args):
    assert refusal(run(*args)).endswith(": an empty path; give a directory")
