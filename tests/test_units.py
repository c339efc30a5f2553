"""tiered.units: byte sizes in, human sizes out."""

from __future__ import annotations

import math

import pytest

from tiered.errors import ConfigError, TieredError
from tiered.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GB", 2_000_000_000),
        ("2GiB", 2 * 2**30),
        ("2 GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1e9", 1_000_000_000),
        ("1.5e9", 1_500_000_000),
        ("80GB", 80_000_000_000),
        ("4TB", 4_000_000_000_000),
        ("1.5KiB", 1536),
        ("123", 123),
        ("0", 0),
        ("7b", 7),
        (123, 123),
        (1e9, 1_000_000_000),
    ],
)
def test_parse_accepts(text: str | int | float, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_parse_integers_exactly_beyond_float_precision() -> None:
    # 2**70 + 1 is not representable as a float; a float detour would drop the +1.
    assert parse_bytes(2**70 + 1) == 2**70 + 1
    assert parse_bytes(str(2**70 + 1)) == 2**70 + 1
    assert parse_bytes("9007199254740993GiB") == 9007199254740993 * 2**30


def test_parse_accepts_numpy_integers() -> None:
    np = pytest.importorskip("numpy")
    assert parse_bytes(np.int64(4096)) == 4096


@pytest.mark.parametrize("bad", ["abc", "-1", "", "  ", "5XB", "1e999", "GB", "1..5GB", "nan"])
def test_parse_rejects_text_naming_it(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_bytes(bad, what="--gpu-mem")
    message = str(info.value)
    assert "--gpu-mem" in message
    assert repr(bad) in message


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, math.inf, True, None, [1]])
def test_parse_rejects_values(bad: object) -> None:
    with pytest.raises(ConfigError, match="cpu budget"):
        parse_bytes(bad, what="cpu budget")  # type: ignore[arg-type]


def test_errors_are_catchable_as_value_error_and_tiered_error() -> None:
    with pytest.raises(ValueError):
        parse_bytes("abc")
    with pytest.raises(TieredError):
        parse_bytes("abc")


@pytest.mark.parametrize(
    ("n", "binary", "expected"),
    [
        (0, False, "0 B"),
        (999, False, "999 B"),
        (1_500_000_000, False, "1.50 GB"),
        (1_500_000_000, True, "1.40 GiB"),
        (2**30, True, "1.00 GiB"),
        (4 * 10**15, False, "4.00 PB"),
        (10**19, False, "10000.00 PB"),
    ],
)
def test_format_bytes(n: int, binary: bool, expected: str) -> None:
    assert format_bytes(n, binary=binary) == expected


def test_format_parse_round_trip() -> None:
    for n in (1, 4096, 3 * 2**30, 123_456_789_000):
        assert abs(parse_bytes(format_bytes(n).replace(" ", "")) - n) <= n * 0.005 + 1
