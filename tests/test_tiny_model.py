"""``pykv/jobs/tiny_model.py``: the test model's weights are what its seed says, whatever libraries are installed."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import xxhash

from pykv.jobs.tiny_model import TINY_LLAMA, WEIGHTS_FILE, bfloat16_bits, make_tiny_llama, tensor_shapes

SEED0_XXH3 = "e159bbc4ef2b1d3d"  # the safetensors bytes of seed 0: a change here changes every e2e test's model


def read_header(path) -> dict:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length])


def test_seed_zero_gives_the_pinned_bytes(tmp_path):
    model = make_tiny_llama(tmp_path / "m")
    weights = (model / WEIGHTS_FILE).read_bytes()
    manifest = json.loads((model / "pykv-test-model.json").read_text())
    assert xxhash.xxh3_64_hexdigest(weights) == manifest["weights_xxh3_64"] == SEED0_XXH3
    assert manifest["seed"] == 0 and manifest["hidden_size"] == TINY_LLAMA["hidden_size"]
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert {k: config[k] for k in TINY_LLAMA} == TINY_LLAMA


def test_checkpoint_lists_every_llama_tensor_with_its_shape(tmp_path):
    header = read_header(make_tiny_llama(tmp_path / "m") / WEIGHTS_FILE)
    header.pop("__metadata__")
    assert {name: tuple(v["shape"]) for name, v in header.items()} == dict(tensor_shapes(TINY_LLAMA))
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    assert len(header) == 3 + 9 * TINY_LLAMA["num_hidden_layers"]


def test_another_seed_other_weights_and_an_existing_checkpoint_is_kept(tmp_path):
    one = make_tiny_llama(tmp_path / "one", seed=1)
    assert json.loads((one / "pykv-test-model.json").read_text())["weights_xxh3_64"] != SEED0_XXH3
    before = (one / WEIGHTS_FILE).stat().st_mtime_ns
    assert make_tiny_llama(tmp_path / "one", seed=1) == one and (one / WEIGHTS_FILE).stat().st_mtime_ns == before


def test_bfloat16_rounds_to_nearest_even():
    values = np.array([1.0, -2.5, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -8 + 2 ** -20], dtype=np.float32)
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0)
    assert bfloat16_bits(values).tolist() == [0x3F80, 0xC020, 0x3F80, 0x3F82, 0x3F81]


# -- the command line ------------------------------------------------------------------------
def test_help_prints_usage_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from pykv.jobs.tiny_model import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0 and "usage: python -m pykv.jobs.tiny_model" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [["--", "--help"], ["--", "-m"], ["--seed"], ["-x"], []])
def test_option_like_or_missing_directories_are_refused(tmp_path, monkeypatch, capsys, argv):
    from pykv.jobs.tiny_model import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and "error: " in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_writes_the_model_into_the_directory_given(tmp_path, capsys):
    from pykv.jobs.tiny_model import main

    assert main([str(tmp_path / "m"), "--seed", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "pykv-test-model.json").read_text())["seed"] == 1
