"""``pykv config`` prints a --kv-transfer-config that PykvConfig reads back unchanged."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.config import PykvConfig


def run(*args):
    return CliRunner().invoke(app, list(args))


def test_config_round_trips_through_pykv_config():
    result = run("config", "--root", "/srv/kv", "--dram", "16G", "--dram-policy", "arc", "--io-depth", "8",
                 "--set", "open_ahead=4", "--block-tokens", "512")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kv_connector"] == "PykvOffloadingConnector"
    assert data["kv_load_failure_policy"] == "recompute"  # failed loads recompute, never error
    extra = data["kv_connector_extra_config"]
    assert extra["block_size"] == 512 and extra["spec_name"] == "PykvSpec"
    config = PykvConfig.from_extra_config(extra)
    assert (config.root, config.dram_bytes, config.dram_policy, config.io_depth, config.open_ahead) == \
        ("/srv/kv", 16 << 30, "arc", 8, 4)


def test_config_rejects_unknown_keys_and_bad_values_in_one_line():
    for args, needle in ((["--set", "bogus=1"], "kv_connector_extra_config.bogus: unknown key"),
                         (["--dram", "12Q"], "kv_connector_extra_config.dram_bytes: cannot parse size"),
                         (["--set", "novalue"], "--set: expected KEY=VALUE")):
        result = run("config", "--root", "/srv/kv", *args)
        assert result.exit_code == 2 and result.stdout == ""
        assert result.stderr.startswith("pykv: error: ") and needle in result.stderr
        assert result.stderr.count("\n") == 1


def test_config_requires_root():
    result = run("config")
    assert result.exit_code == 2 and "--root" in result.stderr
