"""Human-written sizes, durations and integer lists (pykv/units.py)."""

from __future__ import annotations

import pytest

from pykv.errors import InputError
from pykv.units import MAX_SIZE, format_size, is_unit_word, parse_duration, parse_int_list, parse_size, require_multiple

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize("text, expected", [
    ("4096", 4096),
    ("28M", 28 * MiB),
    ("500G", 500 * GiB),
    ("1.5GiB", 3 * GiB // 2),
    ("2k", 2 * KiB),
    ("2K", 2 * KiB),
    ("12 MiB", 12 * MiB),
    ("1.5gb", 3 * GiB // 2),
    ("3T", 3 << 40),
    ("1P", 1 << 50),
    ("0", 0),
    ("  64M ", 64 * MiB),
    ("100B", 100),
    (4096, 4096),
    (0, 0),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected
    assert isinstance(parse_size(text), int)


@pytest.mark.parametrize("text", ["garbage", "12Q", "-1", "", "M", "1e3", "1.5.5G", "12 M B", "0x10", "16X", "16 GBs",
                                  "16GBs", "1e3G", "-1G", "1iB", "16 ib", "16BB", "16 G B", "16KG", "GB", "16 bytes"])
def test_parse_size_rejects(text):
    with pytest.raises(InputError, match=r"^cache-size: cannot parse size"):
        parse_size(text, field="cache-size")


@pytest.mark.parametrize("text, expected", [("16GB", 16 * GiB), ("16 G", 16 * GiB), ("16gib", 16 * GiB),
                                            ("16 KiB", 16 * KiB), ("16", 16), ("16B", 16), ("16 b", 16),
                                            ("1.5P", 3 << 49), ("8TB", 8 << 40)])
def test_every_unit_spelling_is_binary_and_a_bare_number_is_bytes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["9" * 400, "9" * 400 + "G", str(MAX_SIZE + 1), "8192P", "1" + "0" * 39 + "K"])
def test_huge_sizes_are_one_line_naming_the_field(text):
    with pytest.raises(InputError, match=r"^--dram: size .* is too large \(at most 9223372036854775807 bytes\)$"):
        parse_size(text, field="--dram")


@pytest.mark.parametrize("word, unit", [("G", True), ("gb", True), ("GiB", True), ("kib", True), ("B", True),
                                        ("t", True), ("P", True), ("GBs", False), ("X", False), ("iB", False),
                                        ("16G", False), ("", False), ("bytes", False), ("--port", False)])
def test_a_unit_alone_is_recognised(word, unit):
    assert is_unit_word(word) is unit


def test_parse_size_rejects_negative_int():
    with pytest.raises(InputError, match=r"^cache-size: must not be negative"):
        parse_size(-1, field="cache-size")


def test_parse_size_default_field_name():
    with pytest.raises(InputError, match=r"^size:"):
        parse_size("garbage")


@pytest.mark.parametrize("text, expected", [
    ("10m", 600.0),
    ("30s", 30.0),
    ("2h", 7200.0),
    ("1d", 86400.0),
    ("5", 5.0),
    ("1.5h", 5400.0),
    (" 10 m ", 600.0),
    (7, 7.0),
    (2.5, 2.5),
])
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected
    assert isinstance(parse_duration(text), float)


@pytest.mark.parametrize("text", ["x", "", "-5", "10y", "m", "5 minutes"])
def test_parse_duration_rejects(text):
    with pytest.raises(InputError, match=r"^max-age: cannot parse duration"):
        parse_duration(text, field="max-age")


def test_parse_duration_rejects_negative_number():
    with pytest.raises(InputError, match=r"^max-age: must not be negative"):
        parse_duration(-1.0, field="max-age")


@pytest.mark.parametrize("text, expected", [
    ("1,4,16,64", [1, 4, 16, 64]),
    ("8", [8]),
    (" 3 , 4 ", [3, 4]),
    ("2,2", [2, 2]),
])
def test_parse_int_list(text, expected):
    assert parse_int_list(text) == expected


def test_parse_int_list_minimum_can_be_lowered():
    assert parse_int_list("0,1", minimum=0) == [0, 1]


@pytest.mark.parametrize("text", ["0,1", "", "a", "1,,2", "1,a", "-1", "1.5", "+2", "²", "1,²"])
def test_parse_int_list_rejects(text):
    with pytest.raises(InputError, match=r"^depths: .* is not an integer >= 1"):
        parse_int_list(text, field="depths")


@pytest.mark.parametrize("value, multiple", [(4096, 4096), (8192, 4096), (48, 16), (1, 1)])
def test_require_multiple_accepts(value, multiple):
    assert require_multiple(value, multiple, field="slot-bytes") == value


@pytest.mark.parametrize("value, multiple", [(0, 4096), (-4096, 4096), (4097, 4096), (100, 16)])
def test_require_multiple_rejects(value, multiple):
    with pytest.raises(InputError, match=rf"^slot-bytes: {value} is not a positive multiple of {multiple}"):
        require_multiple(value, multiple, field="slot-bytes")


@pytest.mark.parametrize("value, expected", [
    (0, "0 B"),
    (1023, "1023 B"),
    (1024, "1.0 KiB"),
    (1536, "1.5 KiB"),
    (28 * MiB, "28.0 MiB"),
    (500 * GiB, "500.0 GiB"),
    (1 << 40, "1.0 TiB"),
    (1 << 50, "1024.0 TiB"),
    (-2048, "-2.0 KiB"),
])
def test_format_size(value, expected):
    assert format_size(value) == expected


@pytest.mark.parametrize("parse, text", [(parse_size, "１２G"), (parse_size, "٣M"), (parse_duration, "１m"),
                                         (parse_duration, "1.５s"), (parse_int_list, "1,２"), (parse_size, "12\u00a0G")])
def test_only_ascii_digits_and_spaces_are_numbers(parse, text):
    """Python's ``int``/``float`` read any script's digits; a size, duration or list is written in ASCII."""
    with pytest.raises(InputError) as refused:
        parse(text)
    assert "\n" not in str(refused.value)
