"""Namespaces: fingerprint stability and sensitivity, description round trip (pykv/namespace.py)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from pykv.errors import InputError
from pykv.namespace import Namespace


def make(**changes) -> Namespace:
    fields = dict(model="meta-llama/Llama-3.1-8B", dtype="bfloat16", kv_layout="NHD",
                  tokens_per_block=16, tp_size=2, tp_rank=0, pp_rank=0, format_version=1,
                  extra=(("kv_cache_dtype", "auto"),))
    fields.update(changes)
    return Namespace(**fields)


def test_equal_fields_give_equal_fingerprints():
    a, b = make(), make()
    assert a is not b
    assert a == b
    assert a.fingerprint == b.fingerprint
    assert a.id == b.id


def test_fingerprint_is_16_bytes_and_id_is_its_hex():
    ns = make()
    assert isinstance(ns.fingerprint, bytes)
    assert len(ns.fingerprint) == 16
    assert ns.id == ns.fingerprint.hex()
    assert re.fullmatch(r"[0-9a-f]{32}", ns.id)


@pytest.mark.parametrize("change", [
    {"model": "meta-llama/Llama-3.1-70B"},
    {"dtype": "float16"},
    {"kv_layout": "HND"},
    {"tokens_per_block": 32},
    {"tp_size": 4},
    {"tp_rank": 1},
    {"pp_rank": 1},
    {"format_version": 2},
    {"extra": ()},
    {"extra": (("kv_cache_dtype", "fp8"),)},
    {"extra": (("kv_cache_dtype", "auto"), ("lora", "adapter-1"))},
], ids=lambda change: "-".join(f"{k}={v}" for k, v in change.items()))
def test_changing_any_field_changes_the_fingerprint(change):
    base = make()
    changed = make(**change)
    assert changed != base
    assert changed.fingerprint != base.fingerprint
    assert changed.id != base.id


def test_every_field_is_covered_by_the_sensitivity_test():
    names = {f.name for f in dataclasses.fields(Namespace)}
    assert names == {"model", "dtype", "kv_layout", "tokens_per_block", "tp_size", "tp_rank",
                     "pp_rank", "format_version", "extra", "label"}  # label: shown, not fingerprinted


def test_extra_order_does_not_matter():
    a = make(extra=(("b", "2"), ("a", "1"), ("c", "3")))
    b = make(extra=(("c", "3"), ("a", "1"), ("b", "2")))
    assert a == b
    assert a.extra == (("a", "1"), ("b", "2"), ("c", "3"))
    assert a.fingerprint == b.fingerprint


def test_extra_key_and_value_are_not_interchangeable():
    assert make(extra=(("a", "b"),)).fingerprint != make(extra=(("b", "a"),)).fingerprint


def test_describe_is_json_ready_and_names_every_field():
    described = make().describe()
    assert json.loads(json.dumps(described)) == described
    assert described["model"] == "meta-llama/Llama-3.1-8B"
    assert described["tp_size"] == 2
    assert described["extra"] == {"kv_cache_dtype": "auto"}


@pytest.mark.parametrize("ns", [
    make(),
    make(extra=()),
    make(extra=(("z", "1"), ("a", "2")), tp_size=8, tp_rank=7, pp_rank=3),
    Namespace(model="m", dtype="float16", kv_layout="NHD", tokens_per_block=1),
])
def test_describe_from_description_round_trip(ns):
    assert Namespace.from_description(ns.describe()) == ns
    through_json = json.loads(json.dumps({"id": ns.id, **ns.describe()}))
    restored = Namespace.from_description(through_json)
    assert restored == ns
    assert restored.id == ns.id


def test_from_description_with_unknown_field_is_an_input_error():
    data = {**make().describe(), "colour": "blue"}
    with pytest.raises(InputError, match="namespace description"):
        Namespace.from_description(data)


def test_from_description_with_missing_field_is_an_input_error():
    data = make().describe()
    del data["model"]
    with pytest.raises(InputError, match="model"):
        Namespace.from_description(data)


@pytest.mark.parametrize("tp_size, tp_rank", [(2, 2), (2, -1), (1, 1), (0, 0)])
def test_invalid_tp_rank_is_an_input_error(tp_size, tp_rank):
    with pytest.raises(InputError, match="tp_rank"):
        make(tp_size=tp_size, tp_rank=tp_rank)


@pytest.mark.parametrize("tokens", [0, -16])
def test_invalid_tokens_per_block_is_an_input_error(tokens):
    with pytest.raises(InputError, match="tokens_per_block"):
        make(tokens_per_block=tokens)


def test_namespace_is_immutable():
    ns = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ns.model = "other"  # type: ignore[misc]
