"""``pykv/jobs/model_limit.py``: a model's length limit from its config.json, and calibration lengths against it."""

from __future__ import annotations

import json

import pytest

from pykv.errors import InputError
from pykv.jobs.model_limit import ModelLimit, config_limit, engine_limit, fit_lengths


def model_dir(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return str(tmp_path)


@pytest.mark.parametrize("config, tokens, key", [
    ({"max_position_embeddings": 4096}, 4096, "max_position_embeddings"),
    ({"n_positions": 1024}, 1024, "n_positions"),
    ({"max_seq_len": 2048, "max_position_embeddings": 8192}, 2048, "max_seq_len"),  # the smallest wins
    ({"max_position_embeddings": 2048, "model_max_length": 8192}, 8192, "model_max_length"),  # as vLLM: it overrides
    ({"text_config": {"max_position_embeddings": 32768}}, 32768, "max_position_embeddings"),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}, 16384,
     "max_position_embeddings"),
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 32.0}}, 131072,
     "max_position_embeddings"),  # llama3 and yarn factors already count in the length
])
def test_the_config_limit_is_vllms(tmp_path, config, tokens, key):
    limit = config_limit(model_dir(tmp_path, **config))
    assert limit == ModelLimit(tokens, f"{key} in {tmp_path / 'config.json'}")


@pytest.mark.parametrize("content", [None, "{not json", "[1]", json.dumps({"hidden_size": 8}),
                                     json.dumps({"max_position_embeddings": "lots"})])
def test_no_limit_without_a_readable_length(tmp_path, content):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    assert config_limit(str(tmp_path)) is None
    assert config_limit("meta-llama/Llama-3.2-3B") is None  # a hub id: skipped, vLLM checks it


def test_the_engines_max_model_len_is_the_limit_up_to_the_configs(tmp_path, monkeypatch):
    model = model_dir(tmp_path, max_position_embeddings=4096)
    assert engine_limit(model, {"max_model_len": 2048}) == ModelLimit(2048, "max_model_len in the engine arguments")
    assert engine_limit(model, {"max_model_len": -1}).tokens == 4096  # vLLM fits it to memory: the config's
    assert engine_limit("hub/id", {"max_model_len": 8192}).tokens == 8192
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(InputError, match=r"^--engine-arg max_model_len: 8192 exceeds the model's limit of 4096 tokens "
                                         r"\(max_position_embeddings in .*config\.json\); give at most 4096"):
        engine_limit(model, {"max_model_len": 8192})
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert engine_limit(model, {"max_model_len": 8192}).tokens == 8192


def test_the_longest_length_leaves_room_for_the_prompts_extra_token_and_one_generated():
    limit = ModelLimit(4096, "x")
    assert limit.longest_length(256) == 3840 and limit.longest_length(1) == 4094 and limit.longest_length(2) == 4094
    assert ModelLimit(4098, "x").longest_length(256) == 4096 and ModelLimit(200, "x").longest_length(256) == 0


def test_given_lengths_over_the_limit_are_refused_naming_them_and_the_longest_that_fits():
    limit = ModelLimit(4096, "max_position_embeddings in /m/config.json")
    assert fit_lengths([1024, 3840], limit, 256) == ([1024, 3840], None)
    assert fit_lengths([1024, 81920], None, 256) == ([1024, 81920], None)  # no limit known: vLLM decides
    with pytest.raises(InputError) as error:
        fit_lengths([1024, 4096, 40960, 81920], limit, 256)
    assert str(error.value) == ("--lengths: 4096, 40960 and 81920 do not fit the model's limit of 4096 tokens "
                                "(max_position_embeddings in /m/config.json); give --lengths up to 3840 (a length L "
                                "runs a prompt of L + 1 tokens and generates one)")
    with pytest.raises(InputError, match=r"^--lengths: 8192 does not fit"):
        fit_lengths([8192], limit, 256)


def test_default_lengths_over_the_limit_are_dropped_and_the_longest_that_fits_added():
    limit = ModelLimit(4096, "max_position_embeddings in /m/config.json")
    lengths, note = fit_lengths([1024, 2048, 4096, 81920], limit, 256, defaults=True)
    assert lengths == [1024, 2048, 3840]
    assert note == ("--lengths: measuring 1024, 2048 and 3840 tokens: the default lengths 4096 and 81920 do not fit "
                    "the model's limit of 4096 tokens (max_position_embeddings in /m/config.json)")
    assert fit_lengths([1024, 2048], limit, 256, defaults=True) == ([1024, 2048], None)
    assert fit_lengths([1024, 2048], ModelLimit(600, "x"), 256, defaults=True)[0] == [512]


def test_a_limit_shorter_than_one_block_leaves_nothing_to_measure():
    with pytest.raises(InputError, match=r"^--block-tokens: 256 leaves no length that fits the model's limit of 200"):
        fit_lengths([1024], ModelLimit(200, "x"), 256, defaults=True)
