"""PykvConfig: parsing kv_connector_extra_config, errors naming the key, the vLLM dict."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pykv.errors import InputError

from pykv.config import FIELDS, PykvConfig


def test_defaults_and_written_forms():
    config = PykvConfig.from_extra_config({"root": "/t", "staging_bytes": "28M", "dram_bytes": "2G", "io_depth": "8",
                                           "fsync": "true", "file_mode": "0640", "store_retry_interval": "2m"})
    assert config.staging_bytes == 28 << 20 and config.dram_bytes == 2 << 30 and config.io_depth == 8
    assert config.fsync is True and config.file_mode == 0o640 and config.dir_mode == 0o700
    assert config.store_retry_interval == 120.0
    assert PykvConfig.from_extra_config({"root": "/t"}).staging_bytes is None  # auto
    assert PykvConfig.from_extra_config({"root": "/t"}).breakeven_margin == 0.05
    assert PykvConfig.from_extra_config({"root": "/t", "breakeven_margin": "0"}).breakeven_margin == 0.0
    limited = PykvConfig.from_extra_config({"root": "/t", "max_tree_bytes": "500G", "evict_interval": "2s",
                                            "evict_min_age": "0"})
    assert (limited.max_tree_bytes, limited.evict_interval, limited.evict_min_age) == (500 << 30, 2.0, 0.0)
    default = PykvConfig.from_extra_config({"root": "/t"})
    assert (default.max_tree_bytes, default.evict_interval, default.evict_min_age) == (0, 10.0, 60.0)  # off


def test_vllm_keys_are_ignored():
    extra = {"root": "/t", "spec_name": "PykvSpec", "spec_module_path": "pykv.connector.spec", "block_size": 256,
             "offload_prompt_only": True, "self_describing_kv_events": False}
    assert PykvConfig.from_extra_config(extra).root == "/t"


@pytest.mark.parametrize("key, value", [
    ("io_depth", 0), ("io_depth", "many"), ("io_depth", True), ("staging_bytes", "lots"), ("io_engine", "aio"),
    ("dram_policy", "mru"), ("verify", "none"), ("fsync", "maybe"), ("file_mode", "0999"), ("bogus", 1),
    ("store_retry_interval", "soon"), ("breakeven_margin", -0.1), ("breakeven_margin", "some"),
    ("breakeven_margin", True), ("max_tree_bytes", "-1G"), ("max_tree_bytes", "big"), ("evict_interval", "0s"),
    ("evict_interval", "often"), ("evict_min_age", "-5"),
])
def test_bad_values_name_the_key(key, value):
    with pytest.raises(InputError, match=rf"kv_connector_extra_config\.{key}: "):
        PykvConfig.from_extra_config({"root": "/t", key: value})


def test_root_is_required():
    with pytest.raises(InputError, match=r"kv_connector_extra_config\.root: required"):
        PykvConfig.from_extra_config({"block_size": 256})


def test_kv_transfer_config_round_trips():
    config = PykvConfig.from_extra_config({"root": "/t", "dram_bytes": "1G", "dram_policy": "arc"})
    ktc = config.to_kv_transfer_config(512)
    assert ktc["kv_connector"] == "PykvOffloadingConnector"
    assert ktc["kv_connector_module_path"] == "pykv.connector.connector"
    assert ktc["kv_load_failure_policy"] == "recompute" and ktc["kv_role"] == "kv_both"
    extra = ktc["kv_connector_extra_config"]
    assert extra["spec_name"] == "PykvSpec" and extra["block_size"] == 512
    assert PykvConfig.from_extra_config(extra) == config


def test_every_key_is_documented():
    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    for f in FIELDS:
        assert f"`{f.name}`" in doc, f.name
        assert f.metadata["doc"]
    assert [f.name for f in dataclasses.fields(PykvConfig)] == [f.name for f in FIELDS]


@pytest.mark.parametrize("key, value", [("io_depth", "9" * 400), ("io_depth", 4097), ("open_ahead", 10 ** 300),
                                        ("preload_look_ahead", "1" * 5000), ("io_depth", "0x10"), ("io_depth", -1)])
def test_integer_keys_are_bounded_and_refused_in_one_line(key, value):
    with pytest.raises(InputError) as info:
        PykvConfig.from_extra_config({"root": "/r", key: value})
    message = str(info.value)
    assert message.startswith(f"kv_connector_extra_config.{key}: expected an integer from 1 to ")
    assert "\n" not in message and len(message) < 200
