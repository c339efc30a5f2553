"""Typed readers for raw JSON values: each names the key path it reads in every error.

DeepSpeed configs write element counts as ints, as floats (``1e9``) and as strings (``"5e8"``);
these readers accept all three and reject anything that is not exactly an integer count, so a typo
such as ``"5e8x"`` or ``1.5`` never turns into a silent truncation.
"""

from __future__ import annotations

import errno as _errno
import math
from collections.abc import Iterable
from typing import Any

from tiered.errors import ConfigError

AUTO = "auto"


def is_auto(value: Any) -> bool:
    """True for the Hugging Face placeholder ``"auto"`` (any case)."""
    return isinstance(value, str) and value.strip().lower() == AUTO


def _number(value: Any, path: str, kind: str) -> float:
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"{path}: expected {kind}, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value) if isinstance(value, float) else value
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            raise ConfigError(
                f'{path}: cannot read {value!r} as {kind}; write a number such as 1e9, "5e8" or 100000'
            ) from None
    raise ConfigError(f"{path}: expected {kind}, got {type(value).__name__} {value!r}")


def as_count(value: Any, path: str, *, minimum: int = 0) -> int:
    """An integer count (elements, steps, buffers): 100, 1e9, "5e8". Must be >= `minimum`."""
    number = _number(value, path, "an integer count")
    if isinstance(number, float):
        if math.isnan(number) or math.isinf(number) or number != int(number):
            raise ConfigError(f"{path}: {value!r} is not a whole number; write an integer such as 1e9")
        number = int(number)
    if number < minimum:
        what = "negative" if number < 0 else f"below the minimum {minimum}"
        raise ConfigError(f"{path}: {value!r} is {what}; use a value >= {minimum}")
    return int(number)


def as_float(
    value: Any,
    path: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    min_exclusive: bool = False,
) -> float:
    """A finite float, optionally bounded (`minimum` exclusive when `min_exclusive`)."""
    number = float(_number(value, path, "a number"))
    if math.isnan(number) or math.isinf(number):
        raise ConfigError(f"{path}: {value!r} is not a finite number")
    if minimum is not None and (number < minimum or (min_exclusive and number == minimum)):
        bound = f"> {minimum}" if min_exclusive else f">= {minimum}"
        raise ConfigError(f"{path}: {value!r} is out of range; use a value {bound}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"{path}: {value!r} is out of range; use a value <= {maximum}")
    return number


def as_bool(value: Any, path: str) -> bool:
    """A JSON boolean. Strings like "true" are refused: DeepSpeed's pydantic would coerce them,
    but a quoted boolean in JSON is almost always a templating mistake worth pointing out."""
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{path}: expected true or false, got {value!r}")


def as_str(value: Any, path: str) -> str:
    if isinstance(value, str) and value.strip():
        return value
    raise ConfigError(f"{path}: expected a non-empty string, got {value!r}")


def as_choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    """One of `choices`, compared case-insensitively; returns the canonical spelling."""
    if isinstance(value, str):
        for choice in choices:
            if value.strip().lower() == choice.lower():
                return choice
    raise ConfigError(f"{path}: {value!r} is not one of {', '.join(repr(c) for c in choices)}")


def as_section(value: Any, path: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    raise ConfigError(f"{path}: expected a JSON object {{...}}, got {type(value).__name__} {value!r}")


def as_betas(value: Any, path: str) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"{path}: expected a pair [beta1, beta2] such as [0.9, 0.999], got {value!r}")
    b1 = as_float(value[0], f"{path}[0]", minimum=0.0, maximum=1.0)
    b2 = as_float(value[1], f"{path}[1]", minimum=0.0, maximum=1.0)
    if b1 >= 1.0 or b2 >= 1.0:
        raise ConfigError(f"{path}: betas must be in [0, 1), got {value!r}")
    return (b1, b2)


def errno_codes(names: Iterable[str | int], key: str) -> frozenset[int]:
    """Errno names (or numbers) as codes; ConfigError naming `key` and the bad entry otherwise."""
    codes = set()
    for n in names:
        if isinstance(n, bool):
            raise ConfigError(f"{key}: {n!r} is not an errno name such as 'EAGAIN'")
        if isinstance(n, int):
            codes.add(n)
            continue
        code = getattr(_errno, str(n).upper(), None) if isinstance(n, str) else None
        if not isinstance(code, int):
            raise ConfigError(f"{key}: {n!r} is not an errno name (use names such as 'EAGAIN', 'EIO')")
        codes.add(code)
    return frozenset(codes)
