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


def test_set_reads_values_as_text_for_every_command_alike(tmp_path):
    """One KEY=VALUE parser: ``--set file_mode=600`` is the octal mode 0600 in `pykv config` and
    `pykv serve` alike (read as JSON it was the decimal 600, refused as outside 0000..0777)."""
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
