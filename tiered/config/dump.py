"""`dump_config`: a resolved `TieredConfig` back to JSON, in DeepSpeed's spelling.

The output is explicit (every declared field written at its key's path, derived tiers included;
"auto" only for a key in `TieredConfig.unset`, no optimizer section where that is unset) so that
``load_config(dump_config(cfg)) == cfg``: a run's exact configuration can be saved next to its
checkpoint and reloaded without the model that resolved its "auto" values. The paths come from
the schema's declarations ([Note: one declaration per key] in declare.py); only the fields that
are not one key each (the dtype, the tiers, the scheduler) are written by hand here.
"""

from __future__ import annotations

from typing import Any

import torch

from tiered.config.declare import declared_fields
from tiered.config.schema import TieredConfig


def _attr(cfg: TieredConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else dict(value) if isinstance(value, dict) else value


def _put(out: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = out
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def dump_config(cfg: TieredConfig) -> dict[str, Any]:
    """JSON-able dict that `load_config` turns back into an equal `TieredConfig`."""
    out: dict[str, Any] = {}
    for attr, _, decl in declared_fields(TieredConfig):
        value = _attr(cfg, attr)
        if value is None and not decl.section.startswith("tiered"):
            continue  # an absent DeepSpeed key means None (tiered's own are written: null is a value there)
        _put(out, decl.path, _json(value))
    dtype = cfg.precision.dtype
    _put(out, "bf16.enabled", dtype == torch.bfloat16)
    _put(out, "fp16.enabled", dtype == torch.float16)
    _put(
        out,
        "tiered.tiers",
        {
            name: {"backend": dict(spec.backend), "budget": spec.budget_bytes}
            for name, spec in cfg.tiered.tiers.items()
        },
    )
    if cfg.scheduler is not None:
        out["scheduler"] = {"type": cfg.scheduler.type, "params": dict(cfg.scheduler.params)}
    for path in cfg.unset:  # a placeholder is not a value: write what the config said
        if path == "optimizer":
            del out["optimizer"]
            continue
        _put(out, path, "auto")
    return out
