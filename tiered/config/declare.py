"""The declaration of a config key: one `key(...)` on its schema dataclass field.

[Note: one declaration per key]
Every configuration key that sets a field of the resolved `TieredConfig` is declared once, on
that field in schema.py::

    stage: int = key(0, "zero_optimization.stage", "0-3; all run on the partitioned machinery")

The field's type and default are the key's type and default (DeepSpeed's code default, unless
the doc line says why not); `path` is its DeepSpeed (or ``tiered.``) spelling, `aliases` the
other spellings DeepSpeed accepts in the same section; `doc` is the line docs/config.md shows.
Everything else is derived from these fields, never written again:

- keys.py classifies the declared paths (and their aliases) from them (`declared_rules`);
- sections.py reads plain counts, numbers and flags with `read_key`, which takes the names,
  the bounds and the default from here (a key with rules of its own is parsed by hand there,
  its default still read from the field);
- dump.py writes every declared field at its path;
- auto.py's formulas are keyed by the declared paths (`auto="model"`), a test checks both ways;
- docs/config.md's key table (with its default column) is generated from keys.py
  (``python -m tiered.config --markdown``) and a test checks it is the file's.

A test (tests/test_config_declared.py) parses an empty config and checks every declared field
equals its dataclass default, and gives every declared key a value of its own and checks it
reaches its field. Adding a key is therefore: one field with `key(...)` (and, if it needs rules
of its own, its line in the section's parser); then regenerate the docs table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

KeyKind = Literal["supported", "accepted"]
AutoMeaning = Literal["default", "model", "caller", "refused"]
_META = "tiered.key"


@dataclass(frozen=True)
class KeyDecl:
    """What one schema field says about its config key (see [Note: one declaration per key])."""

    path: str
    """The canonical spelling, as a dotted path ("zero_optimization.stage3_max_live_parameters")."""
    doc: str
    """What tiered does with it: one line, shown in docs/config.md; for an ``accepted`` key the reason it has no effect."""
    aliases: tuple[str, ...] = ()
    """Other names of the same key in the same section ("max_live_parameters")."""
    kind: KeyKind = "supported"
    """``supported``: the engine reads the field; ``accepted``: parsed and kept, no effect ([Note: key classification])."""
    auto: AutoMeaning = "default"
    """What ``"auto"`` means: the default, a value from the model (auto.py), the caller's
    keyword (hyper.py), or refused (an error, as for any other string)."""
    minimum: float | None = None
    maximum: float | None = None
    min_exclusive: bool = False
    default_doc: str = ""
    """The default as docs/config.md shows it, where the value alone would mislead (a None resolved later)."""

    @property
    def section(self) -> str:
        return self.path.rpartition(".")[0]

    @property
    def names(self) -> tuple[str, ...]:
        """Every spelling inside the section, the canonical one first."""
        return (self.path.rpartition(".")[2], *self.aliases)


def key(
    default: Any = dataclasses.MISSING,
    path: str = "",
    doc: str = "",
    *,
    default_factory: Callable[[], Any] | None = None,
    aliases: tuple[str, ...] = (),
    kind: KeyKind = "supported",
    auto: AutoMeaning = "default",
    minimum: float | None = None,
    maximum: float | None = None,
    min_exclusive: bool = False,
    default_doc: str = "",
) -> Any:
    """A dataclass field that declares its config key ([Note: one declaration per key])."""
    decl = KeyDecl(path, doc, aliases, kind, auto, minimum, maximum, min_exclusive, default_doc)
    if not path or not doc:
        raise ValueError(f"key(): every declared key needs a path and a doc line, got {decl!r}")
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={_META: decl})
    return dataclasses.field(default=default, metadata={_META: decl})


def declaration(cls: type, name: str) -> KeyDecl:
    """The declaration on field `name` of schema class `cls`."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            decl = f.metadata.get(_META)
            if not isinstance(decl, KeyDecl):
                raise KeyError(f"{cls.__name__}.{name} declares no config key")
            return decl
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise KeyError(f"field {f.name} has no default")


def declared_fields(cls: type, owner: str = "") -> Iterator[tuple[str, dataclasses.Field[Any], KeyDecl]]:
    """(attribute path, field, declaration) for every declared field under `cls`, nested
    schema dataclasses included ("zero.offload_param.device", ...), in declaration order."""
    for f in dataclasses.fields(cls):
        attr = f"{owner}.{f.name}" if owner else f.name
        decl = f.metadata.get(_META)
        if decl is not None:
            yield attr, f, decl
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                yield from declared_fields(type(value), attr)
