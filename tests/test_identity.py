"""What a namespace is keyed on: the model's content and vLLM's block-hash seed (pykv/connector/identity.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from pykv.connector import identity
from pykv.connector.identity import local_model_identity, model_identity
from pykv.namespace import Namespace


def make_model(directory, weights: bytes = b"w" * 3_000_000, config: dict | None = None):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config or {"hidden_size": 8, "num_hidden_layers": 2}))
    (directory / "model.safetensors").write_bytes(weights)
    return directory


def identity_of(path) -> str:
    local_model_identity.cache_clear()
    return model_identity(str(path))


def test_a_copied_model_directory_has_the_same_identity(tmp_path):
    original = make_model(tmp_path / "a" / "llama")
    copy = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(original, copy)
    assert identity_of(original) == identity_of(copy)
    assert identity_of(original).startswith("files:")


def test_config_formatting_does_not_matter_but_content_does(tmp_path):
    a = make_model(tmp_path / "a", config={"hidden_size": 8, "num_hidden_layers": 2})
    b = make_model(tmp_path / "b")
    (b / "config.json").write_text('{\n  "num_hidden_layers": 2,\n  "hidden_size": 8\n}\n')
    c = make_model(tmp_path / "c", config={"hidden_size": 8, "num_hidden_layers": 3})
    assert identity_of(a) == identity_of(b) != identity_of(c)


@pytest.mark.parametrize("change", ["first MiB", "last MiB", "size", "name"])
def test_two_fine_tunes_with_the_same_config_never_share(tmp_path, change):
    weights = bytearray(b"w" * 3_000_000)
    base = make_model(tmp_path / "base", bytes(weights))
    tuned = make_model(tmp_path / "tuned", bytes(weights))
    target = tuned / "model.safetensors"
    if change == "first MiB":
        weights[10] ^= 1
        target.write_bytes(bytes(weights))
    elif change == "last MiB":
        weights[-10] ^= 1
        target.write_bytes(bytes(weights))
    elif change == "size":
        target.write_bytes(bytes(weights) + b"x")
    else:
        target.rename(tuned / "model-00001.safetensors")
    assert identity_of(base) != identity_of(tuned)


def test_a_hub_id_without_a_local_snapshot_is_id_and_revision(tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "_cached_snapshot", lambda repo, revision: None)
    assert model_identity("org/model-that-is-not-here") == "hub:org/model-that-is-not-here@default"
    assert model_identity("org/m", "abc123") == "hub:org/m@abc123"


def test_a_cached_hub_snapshot_is_identified_by_its_files(tmp_path, monkeypatch):
    snapshot = make_model(tmp_path / "snapshots" / "0123")
    monkeypatch.setattr(identity, "_cached_snapshot", lambda repo, revision: str(snapshot))
    assert identity_of("org/model") == identity_of(snapshot)


def test_the_label_is_shown_but_not_part_of_the_fingerprint():
    fields = dict(model="files:a:b", dtype="bfloat16", kv_layout="NHD", tokens_per_block=256)
    a, b = Namespace(**fields, label="/models/llama"), Namespace(**fields, label="/copy/of/llama")
    assert a.id == b.id and a == b
    assert a.describe()["label"] == "/models/llama"
    assert Namespace.from_description({"id": a.id, **a.describe()}).label == "/models/llama"
    assert Namespace(**fields).id == a.id


# -- the block-hash seed (vLLM's rules, so vLLM is needed) ----------------------------------------
def test_the_seed_fingerprint_follows_pythonhashseed(monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    zero = identity.hash_seed_fingerprint("sha256", "engine-1")
    assert zero == identity.hash_seed_fingerprint("sha256", "engine-2")  # the engine does not matter
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    assert identity.hash_seed_fingerprint("sha256", "engine-1") != zero
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert identity.hash_seed_fingerprint("xxhash", "engine-1") != zero  # another hash algorithm


def test_the_seed_fingerprint_is_the_hash_of_vllms_none_hash(monkeypatch):
    pytest.importorskip("vllm")
    import xxhash
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))  # as the engine does at start
    assert identity.hash_seed_fingerprint("sha256", "e") == xxhash.xxh3_64_hexdigest(kv_cache_utils.NONE_HASH)


def test_without_a_seed_a_random_vllm_seed_gets_a_namespace_of_its_own(monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    random_a = identity.hash_seed_fingerprint("xxhash", "engine-a")
    assert random_a == "random:engine-a" != identity.hash_seed_fingerprint("xxhash", "engine-b")


def test_an_unset_seed_is_one_warning_line(monkeypatch, caplog):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(identity, "_warned", set())
    with caplog.at_level("WARNING", logger="pykv"):
        identity.warn_about_seed("random:e")
        identity.warn_about_seed("random:e")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "PYTHONHASHSEED is unset" in lines[0] and "random seed" in lines[0]
    monkeypatch.setattr(identity, "_warned", set())
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    caplog.clear()
    with caplog.at_level("WARNING", logger="pykv"):
        identity.warn_about_seed("abc")
    assert caplog.records == []
