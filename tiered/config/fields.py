"""A raw config seen through the schema's fields: which declared keys a user wrote, and a copy
of a raw config with some fields set, each at its declared spelling.

[Note: a raw config by field]
A caller that lays values onto a user's config (the planner's ``auto_config``, [Note: auto
config] in tiered/planning/auto.py) names what it sets by `TieredConfig` attribute path
(``"zero.sub_group_size_numel"``), never by JSON key: the key, its aliases and its section come
from the field's declaration ([Note: one declaration per key]), so the caller spells nothing and
defaults nothing, and a value it leaves out is the declaration's default once `load_config`
reads the result. `written_fields` says which fields a raw config sets itself (a value that is
neither null nor "auto", under any spelling; DeepSpeed's ``cpu_offload`` / ``cpu_offload_param``
flags count as the devices they set): what such a caller must keep. Call it on a config
`load_config` accepted: it reads the structure, not the values. Two fields are not one key
each and are written here by hand, as `dump_config` does: ``precision.dtype`` (``bf16`` /
``fp16`` ``enabled``) and the tier budgets (`with_tier_budgets`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

import torch

from tiered.config.declare import KeyDecl, declared_fields
from tiered.config.schema import TieredConfig
from tiered.config.values import is_auto

PRECISION_FIELD = "precision.dtype"
"""The one field written as two keys (``bf16.enabled``, ``fp16.enabled``)."""
TIERS_FIELD = "tiered.tiers"
"""The user's own tiers (``tiered.tiers``, not one key: a section of tier specs)."""
_PRECISION_SECTIONS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_DEPRECATED_DEVICE_FLAGS = {
    "zero.offload_optimizer.device": "cpu_offload",
    "zero.offload_param.device": "cpu_offload_param",
}
"""DeepSpeed's older flags that set an offload device to "cpu" (sections.py honours them)."""


@functools.cache
def _declarations() -> dict[str, KeyDecl]:
    return {attr: decl for attr, _, decl in declared_fields(TieredConfig)}


def declared_key(attr: str) -> KeyDecl:
    """The declaration of the field at attribute path `attr` ("zero.sub_group_size_numel")."""
    try:
        return _declarations()[attr]
    except KeyError:
        raise KeyError(f"{attr!r} is not a declared field of TieredConfig") from None


def value_of(cfg: TieredConfig, attr: str) -> Any:
    """The resolved value of `cfg` at attribute path `attr`."""
    value: Any = cfg
    for part in attr.split("."):
        value = getattr(value, part)
    return value


def _section(raw: Mapping[str, Any], section: str) -> Mapping[str, Any] | None:
    node: Any = raw
    for part in filter(None, section.split(".")):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node if isinstance(node, Mapping) else None


def _given(value: Any) -> bool:
    return value is not None and not is_auto(value)


def written_fields(raw: Mapping[str, Any]) -> frozenset[str]:
    """Attribute paths of the declared fields `raw` sets itself ([Note: a raw config by field])."""
    out = set()
    for attr, decl in _declarations().items():
        section = _section(raw, decl.section)
        if section is not None and any(_given(section.get(name)) for name in decl.names):
            out.add(attr)
    zero = _section(raw, "zero_optimization")
    for attr, flag in _DEPRECATED_DEVICE_FLAGS.items():
        if zero is not None and zero.get(flag) is True:
            out.add(attr)
    if any(_given((_section(raw, s) or {}).get("enabled")) for s in ("bf16", "bfloat16", "fp16")):
        out.add(PRECISION_FIELD)
    if (_section(raw, "tiered") or {}).get("tiers"):
        out.add(TIERS_FIELD)
    return frozenset(out)


def _node(out: dict[str, Any], section: str) -> dict[str, Any]:
    node = out
    for part in filter(None, section.split(".")):
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    return node


def with_fields(raw: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `raw` with each field of `values` (attribute path -> value) set at its key's
    canonical spelling, the key's other spellings removed ([Note: a raw config by field])."""
    out = copy.deepcopy(dict(raw))
    for attr, value in values.items():
        if attr == PRECISION_FIELD:
            for dtype, name in _PRECISION_SECTIONS.items():
                if value == dtype or isinstance(out.get(name), dict):
                    _node(out, name)["enabled"] = value == dtype
            out.pop("bfloat16", None)
            continue
        decl = declared_key(attr)
        node = _node(out, decl.section)
        for alias in decl.aliases:
            node.pop(alias, None)
        node[decl.names[0]] = list(value) if isinstance(value, tuple) else value
    return out


def with_tier_budgets(raw: Mapping[str, Any], budgets: Mapping[str, int | str]) -> dict[str, Any]:
    """A copy of `raw` whose ``tiered.tiers`` are `budgets` (tier -> bytes or a size such as
    "64KiB"), each tier's backend the derived one ([Note: default tiers] in tiers.py)."""
    out = copy.deepcopy(dict(raw))
    _node(out, "tiered")["tiers"] = {name: {"budget": b} for name, b in budgets.items()}
    return out
