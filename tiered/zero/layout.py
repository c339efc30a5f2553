"""The groups a model is split into and what gathering them costs in the "gpu" tier, computed
from the module tree alone: what `ZeroParameters` builds its partitions from, and what
`tiered.planning` predicts a config's memory from (on the meta device), so that the two never
disagree ([Note: one memory model] in tiered/planning/needs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tiered.shards import padded_numel
from tiered.zero.budget import GpuGatherNeed, PlannedSize, check_gather_budgets
from tiered.zero.leaf import LeafSet, find_leaf_modules
from tiered.zero.plan import PlannedGroup
from tiered.zero.sharding import ALIGNMENT_NUMEL, ModuleMaps, map_modules, plan_model_groups

if TYPE_CHECKING:
    from tiered.config.schema import ZeroConfig


@dataclass(frozen=True)
class GroupLayout:
    """A model's groups before any partition exists, and the gather need they imply."""

    planned: list[PlannedGroup]
    leaf_names: list[str]
    managed: dict[int, tuple[int, int]]
    """id(param) -> (group index, entry index)."""
    modules: ModuleMaps
    """Per module, the groups its hooks gather (a leaf: its whole subtree's)."""
    leaves: LeafSet
    gpu_need: GpuGatherNeed
    """Bytes the schedule holds in "gpu" at its peak ([Note: the live budget])."""
    world_size: int

    def shard_numel(self, i: int) -> int:
        """Elements of group `i`'s shard on each rank (its full buffer padded, then split)."""
        return padded_numel(self.planned[i].numel, self.world_size, ALIGNMENT_NUMEL) // self.world_size


def plan_layout(
    model: nn.Module,
    z: ZeroConfig,
    *,
    gpu_budget_bytes: int | None,
    compute_dtype: torch.dtype,
    world_size: int,
    param_tier: str,
    grad_tier: str,
) -> GroupLayout:
    """Plan `model`'s groups under `z` and check they can be gathered (CapacityError / ConfigError
    before any partition is written). See [Note: group planning], [Note: the live budget]."""
    leaf_names = find_leaf_modules(model, z.leaf_module)  # [Note: leaf modules]
    planned = plan_model_groups(
        model,
        z,
        gpu_budget_bytes=gpu_budget_bytes,
        compute_dtype=compute_dtype,
        world_size=world_size,
        leaves=tuple(leaf_names),
    )
    managed = {id(p): (i, j) for i, pg in enumerate(planned) for j, (_, p) in enumerate(pg.params)}
    modules = map_modules(model, managed)
    leaves = LeafSet(
        model, leaf_names, [pg.leaf for pg in planned], [pg.trainable for pg in planned], managed
    )
    for mid, leaf in leaves.by_module.items():  # entering a leaf gathers its whole subtree
        modules.groups[mid] = leaf.groups
    ws = world_size
    gpu_need = check_gather_budgets(
        [PlannedSize(pg.numel, padded_numel(pg.numel, ws, ALIGNMENT_NUMEL), pg.persistent) for pg in planned],
        [(modules.names[mid], idxs) for mid, idxs in modules.groups.items()],
        max_live=z.max_live_parameters_numel,
        gpu_budget_bytes=gpu_budget_bytes,
        param_itemsize=torch.empty(0, dtype=compute_dtype).element_size(),
        world_size=ws,
        param_tier=param_tier,
        grad_tier=grad_tier,
        needs_fetch=ws > 1 or param_tier != "gpu",
    )
    return GroupLayout(planned, list(leaf_names), managed, modules, leaves, gpu_need, world_size)
