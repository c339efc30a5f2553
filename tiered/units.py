"""Byte sizes: parse "2GiB", "80GB", "1e9", 123 and print them back for humans."""

from __future__ import annotations

import math
import numbers
import re

from tiered.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, what: str = "size") -> int:
    """Parse a byte count: 1073741824, 1e9, "1e9", "2GB" (10^9), "2GiB" (2^30), "512 MiB".

    Raises ConfigError naming `what` and the offending text for anything else, including
    negative values, NaN and unknown units.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a byte size such as 2GiB, 80GB or 1e9, got {value!r}")
    if isinstance(value, numbers.Integral):
        # Exact: a float would round byte counts above 2**53.
        if value < 0:
            raise ConfigError(f"{what}: {value!r} is not a non-negative finite size")
        return int(value)
    if isinstance(value, numbers.Real):
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match:
            raise ConfigError(
                f"{what}: cannot read {value!r} as a byte size; write e.g. 2GiB, 80GB, 512MiB or 1e9"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
        if match.group(1).isdigit() and unit in _UNITS:
            return int(match.group(1)) * _UNITS[unit]  # exact for any length of digits
        if unit not in _UNITS:
            raise ConfigError(
                f"{what}: unknown unit {match.group(2)!r} in {value!r}; use B, KB, MB, GB, TB "
                "(powers of 10) or KiB, MiB, GiB, TiB (powers of 2)"
            )
    else:
        raise ConfigError(f"{what}: expected a byte size such as 2GiB, 80GB or 1e9, got {value!r}")
    if math.isnan(number) or math.isinf(number) or number < 0:
        raise ConfigError(f"{what}: {value!r} is not a non-negative finite size")
    return int(round(number * _UNITS[unit]))


def format_bytes(n: int | float, *, binary: bool = False) -> str:
    """1_500_000_000 -> "1.50 GB" (or "1.40 GiB" with binary=True)."""
    base, names = (
        (1024.0, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"])
        if binary
        else (
            1000.0,
            ["B", "KB", "MB", "GB", "TB", "PB"],
        )
    )
    value = float(n)
    for name in names:
        if abs(value) < base or name == names[-1]:
            return f"{value:.0f} {name}" if name == "B" else f"{value:.2f} {name}"
        value /= base
    raise AssertionError("unreachable")


def align_up(n: int, align: int) -> int:
    """`n` rounded up to a multiple of `align` (bytes to a block, a page, a direct-I/O unit)."""
    return (n + align - 1) // align * align


def align_down(n: int, align: int) -> int:
    """`n` rounded down to a multiple of `align`."""
    return n // align * align
