"""Where each trainable group's optimizer step runs and its state lives, decided once at
initialize, and the staging bytes that choice costs (what the engine's capacity check and
`OffloadedAdam` both take; see [Note: sub-group pipeline] in tiered/optim/offload.py).

[Note: twin-flow ratio]
``offload_optimizer.ratio`` splits the groups between the CPU kernel and the GPU kernel: the
``round(ratio * n)`` largest groups (ties by execution order) run on the CPU (their state on the
optimizer tier), the rest keep their state in "gpu" and run ``tiered_ext.gpu_adam_step`` there.
(DeepSpeed's Twin-Flow assigns the *last* fraction by index; by size is what bounds GPU memory.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from tiered.config.schema import TieredConfig
from tiered.shards import ShardGroup

if TYPE_CHECKING:
    from tiered.tiers import Partition, TierManager

STATE_SUFFIXES = ("master", "exp_avg", "exp_avg_sq")
_FP32 = 4


@dataclass(frozen=True)
class GroupPlan:
    """Where one group's optimizer step runs and where its bytes live."""

    side: str
    """"cpu" (tiered_ext.adam_step) or "gpu" (tiered_ext.gpu_adam_step)."""
    state_home: str
    """Home tier of master / exp_avg / exp_avg_sq."""
    compute_tier: str
    """Memory-like tier the states and the gradient are fetched into for the update."""
    stage_tier: str
    """Tier where the new compute-dtype parameter is written (then evicted to its home)."""


class StatePartitions(NamedTuple):
    """One group's optimizer state in the TierManager (fp32, shard_numel elements each)."""

    master: Partition
    """The fp32 master; the group's param partition itself where [Note: fp32 master is the parameter]."""
    exp_avg: Partition
    exp_avg_sq: Partition


def master_is_param(group: ShardGroup, plan: GroupPlan, compute_dtype: torch.dtype) -> bool:
    """[Note: fp32 master is the parameter] (tiered/optim/offload.py): in an fp32 run whose CPU step
    finds the parameter at the state's home, the param partition is the master (no copy of its own)."""
    return compute_dtype == torch.float32 and plan.side == "cpu" and group.param.home == plan.state_home


def state_partition_specs(
    group: ShardGroup, plan: GroupPlan, compute_dtype: torch.dtype
) -> list[tuple[str, int, torch.dtype, str]]:
    """(name, numel, dtype, home) of each optimizer-state partition `OffloadedAdam` creates for
    `group`: what it allocates, and what the engine's capacity check counts before it does."""
    suffixes = STATE_SUFFIXES[1:] if master_is_param(group, plan, compute_dtype) else STATE_SUFFIXES
    return [(f"{group.name}.{s}", group.shard_numel, torch.float32, plan.state_home) for s in suffixes]


def plan_optimizer_placement(
    groups: Sequence[ShardGroup], cfg: TieredConfig, optimizer_tier: str, *, gpu_is_host: bool
) -> list[GroupPlan]:
    """Where each trainable group's step runs and its state lives (CPU or GPU kernel, which
    tiers). See [Note: twin-flow ratio] and [Note: max_in_cpu]."""
    n = len(groups)
    if optimizer_tier == "gpu":
        cpu_side: set[int] = set()
    else:
        ratio = float(cfg.zero.offload_optimizer.ratio)
        n_cpu = n if ratio >= 1.0 else int(round(ratio * n))
        by_size = sorted(range(n), key=lambda i: (-groups[i].shard_numel, i))
        cpu_side = set(by_size[:n_cpu])
    plans = []
    for i, g in enumerate(groups):
        home = g.param.home
        if i in cpu_side:
            # The CPU kernel needs host tensors; a host-memory "gpu" tier can take the new
            # params directly (no extra copy), a real GPU gets them by an evict (H2D).
            stage = "gpu" if home == "gpu" and gpu_is_host else "cpu"
            plans.append(GroupPlan("cpu", optimizer_tier, "cpu", stage))
        else:
            plans.append(GroupPlan("gpu", "gpu", "gpu", "gpu"))
    return plans


def pipeline_bytes(
    groups: Sequence[ShardGroup], plans: Sequence[GroupPlan], buffer_count: int, compute_dtype: torch.dtype
) -> dict[str, int]:
    """Staging bytes per tier the pipeline holds beyond the partitions' homes:
    per side, the ``buffer_count`` largest of (3 states x 4 B if read from a slower home
    + 4 B grad if not resident there + param bytes if staged away from home) x shard_numel.
    See [Note: sub-group pipeline]."""
    need: dict[str, int] = {}
    psize = torch.tensor([], dtype=compute_dtype).element_size()
    for side in ("cpu", "gpu"):
        per_group = []
        for g, p in zip(groups, plans, strict=True):
            if p.side != side:
                continue
            b = 0
            if p.state_home != p.compute_tier:
                b += 3 * _FP32 * g.shard_numel
            assert g.grad is not None, f"group {g.name} is frozen: it has no optimizer step"
            if g.grad.home != p.compute_tier:
                b += _FP32 * g.shard_numel
            if g.param.home != p.stage_tier:
                b += psize * g.shard_numel
            per_group.append(b)
        if per_group:
            depth = min(max(1, buffer_count), len(per_group))
            need[side] = need.get(side, 0) + sum(sorted(per_group, reverse=True)[:depth])
    return need


def tier_is_host(tm: TierManager, name: str) -> bool:
    """Tier `name`'s memory is host memory (a "gpu" tier on a machine without one)."""
    return _tier_device(tm, name) == "cpu"


def _tier_device(tm: TierManager, name: str) -> str:
    try:
        return str(tm.tier(name).backend.capabilities.device)
    except Exception:  # noqa: BLE001 - a manager without that tier: treat it as a real device
        return "cuda"
