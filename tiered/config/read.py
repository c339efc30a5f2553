"""Reading one declared key out of a raw section: `read_key` ([Note: one declaration per key]).

The names (canonical and aliases), the bounds, what "auto" means and the default all come from
the schema field's `key(...)`; the field's type decides the reader: a bool is a JSON boolean, an
int an element count (`as_count`), a float a finite number (`as_float`); null and absent both
mean the default.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tiered.config.auto import resolve_from_model
from tiered.config.declare import declaration, field_default
from tiered.config.values import as_bool, as_count, as_float, is_auto
from tiered.errors import ConfigError

_READERS: dict[str, type] = {
    **{t.__name__: t for t in (bool, int, float)},
    **{f"{t.__name__} | None": t for t in (bool, int, float)},
}
"""The field annotations `read_key` reads (schema.py's ``from __future__ import annotations`` makes them strings)."""


def pick(section: dict[str, Any], prefix: str, names: tuple[str, ...]) -> tuple[str, Any] | None:
    """The one present spelling among aliases `names`, or None; two spellings is an error."""
    present = [n for n in names if n in section]
    if len(present) > 1:
        spelled = " and ".join(f"{prefix}.{n}" if prefix else n for n in present)
        raise ConfigError(f"{spelled} are aliases of one setting; keep only one")
    return (present[0], section[present[0]]) if present else None


def default_of(cls: type, name: str) -> Any:
    """The dataclass default of field `name` of `cls` (the key's default)."""
    return field_default(next(f for f in dataclasses.fields(cls) if f.name == name))


def read_key(
    section: dict[str, Any],
    cls: type,
    name: str,
    model: torch.nn.Module | None = None,
    *,
    default: Any = dataclasses.MISSING,
) -> Any:
    """The value of field `name` of schema class `cls` from its raw `section`; `default`
    overrides the field's (a default that depends on another key, e.g. pin_memory)."""
    decl = declaration(cls, name)
    fallback = default_of(cls, name) if default is dataclasses.MISSING else default
    found = pick(section, decl.section, decl.names)
    if found is None:
        return fallback
    written, value = found
    path = f"{decl.section}.{written}" if decl.section else written
    kind = _READERS.get(str(next(f.type for f in dataclasses.fields(cls) if f.name == name)))
    if is_auto(value) and decl.auto != "refused":
        return resolve_from_model(decl.path, model, path) if decl.auto == "model" else fallback
    if value is None:
        return fallback
    if kind is bool:
        return as_bool(value, path)
    if kind is int:
        count = as_count(value, path, minimum=int(decl.minimum or 0))
        if decl.maximum is not None and count > decl.maximum:
            raise ConfigError(f"{path}: {value!r} is out of range; use a value <= {int(decl.maximum)}")
        return count
    if kind is float:
        return as_float(
            value, path, minimum=decl.minimum, maximum=decl.maximum, min_exclusive=decl.min_exclusive
        )
    raise TypeError(f"read_key: {cls.__name__}.{name} is parsed by hand, not by read_key")


def read_keys(
    section: dict[str, Any], cls: type, *names: str, model: torch.nn.Module | None = None
) -> dict[str, Any]:
    """`read_key` for each of `names`, as keyword arguments for `cls`."""
    return {name: read_key(section, cls, name, model) for name in names}
