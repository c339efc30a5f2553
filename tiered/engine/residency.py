"""The engine's side of [Note: residency] (tiered/planning/residency.py): the room its tier
manager's budgets give, and the kept set handed to the manager once the partitions exist.

Lifetime: initialize only. The plan itself is the planner's function, so `tiered plan`, the
bytes formula of `stats()` and the engine keep the same partitions.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from tiered.planning.residency import Residency, TierRoom, config_residency
from tiered.units import format_bytes

if TYPE_CHECKING:
    from tiered.config.schema import TieredConfig
    from tiered.optim.placement import GroupPlan
    from tiered.shards import ShardGroup
    from tiered.tiers import TierFuture, TierManager

log = logging.getLogger(__name__)


def local_ranks(world_size: int) -> int:
    """Ranks of this host (torchrun's LOCAL_WORLD_SIZE, else all of them): they share what the
    host's memory reports free."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    except ValueError:
        return max(1, world_size)


def tier_rooms(tm: TierManager, cfg: TieredConfig, *, world_size: int) -> dict[str, TierRoom]:
    """Per tier of `tm`, its budget as the manager enforces it, whether the user gave it, and
    its backend's size ([Note: residency])."""
    out: dict[str, TierRoom] = {}
    for name in tm.tier_names:
        spec = cfg.tiered.tiers.get(name)
        try:
            total = tm.tier(name).backend.capacity().total_bytes
        except Exception:  # noqa: BLE001 - a backend that cannot tell its size: the reserve's minimum
            total = None
        out[name] = TierRoom(
            tm.budget_bytes(name),
            explicit=spec is not None and spec.budget_bytes is not None,
            total_bytes=total,
            local_ranks=local_ranks(world_size),
        )
    return out


def plan_engine_residency(
    tm: TierManager,
    groups: Sequence[ShardGroup],
    plans: Sequence[GroupPlan],
    cfg: TieredConfig,
    need_bytes: Mapping[str, int],
    memory: Mapping[str, str],
    *,
    world_size: int,
) -> Residency:
    """What this engine's faster tiers keep: `config_residency` at the manager's budgets."""
    return config_residency(
        groups, plans, cfg, need_bytes, memory, tier_rooms(tm, cfg, world_size=world_size)
    )


def keep_resident(tm: TierManager, residency: Residency, *, mode: str = "auto") -> None:
    """Tell the manager what each tier keeps ([Note: kept copies]); a frozen parameter, which no
    step ever stages, is read into its tier now (the others arrive there with their first use).
    Logged once, per tier; `mode` (``tiered.residency``) other than "auto" once too."""
    if mode != "auto":
        log.info(
            "residency: %r (tiered.residency): %s [Note: residency]",
            mode,
            "no tier keeps a copy across steps beyond offload_param.max_in_cpu's parameters"
            if mode == "off"
            else "only host memory keeps copies; a gpu budget's room beyond its need is left to the activations",
        )
    warm: list[TierFuture[None]] = []
    for k in residency.kept:
        part = tm.get(k.name)
        tm.keep(part, k.tier)
        if k.warm and not part.is_resident(k.tier):
            warm.append(tm.prefetch(part, k.tier))
    for f in warm:
        f.result()
    for tier, row in residency.summary().items():
        if row["kept"] or row["room"]:
            log.info(
                "residency: tier %s keeps %s of its %s of room across steps (parameters %s, gradients %s, "
                "optimizer state %s) [Note: residency]",
                tier,
                format_bytes(row["kept"], binary=True),
                format_bytes(row["room"], binary=True),
                format_bytes(row["param"], binary=True),
                format_bytes(row["grad"], binary=True),
                format_bytes(row["state"], binary=True),
            )
