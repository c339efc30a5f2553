"""The groups a model is split into and what gathering them costs in the "gpu" tier, computed
from the module tree alone: what `ZeroParameters` builds its partitions from, and what
`tiered.planning` predicts a config's memory from (on the meta device), so that the two never
disagree ([Note: one memory model] in tiered/planning/needs.py).

[Note: persistent by room]
The gpu tier is a cache of the parameters' home too ([Note: residency] in
tiered/planning/residency.py). A budget the user gives it (``tiered.tiers.gpu.budget``, or the
GPU memory `tiered plan` / ``auto_config`` was told) that has room beyond the working set (the
largest module's gather, the persistent groups, what ``stage3_max_live_parameters`` keeps
gathered) holds more groups persistent: gathered once and kept, as the small ones below
``stage3_param_persistence_threshold`` are. A group earns it by the gathers it saves per step
less the one refresh after each step that changes it: A x (1 + backward re-read) for a frozen
group (a LoRA base: never changed, never read again), one less for a trainable one (so on a GPU
a trainable group only where accumulation or re-reads gather it more than once a step: its new
value crosses to the device once a step either way). Candidates go most saved per byte first
(ties: the larger, then module order), each while the gpu need with it persistent stays within
the budget. A leaf module's groups are gathered together and stay out of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tiered.shards import grad_homes, padded_numel
from tiered.zero.budget import GpuGatherNeed, PlannedSize, check_gather_budgets
from tiered.zero.leaf import LeafSet, find_leaf_modules
from tiered.zero.plan import PlannedGroup
from tiered.zero.rereads import backward_rereads
from tiered.zero.sharding import ALIGNMENT_NUMEL, ModuleMaps, map_modules, plan_model_groups
from tiered.zero.split import groups_of_params, split_params

if TYPE_CHECKING:
    from tiered.config.schema import TieredConfig, ZeroConfig


@dataclass(frozen=True)
class GroupLayout:
    """A model's groups before any partition exists, and the gather need they imply."""

    planned: list[PlannedGroup]
    leaf_names: list[str]
    managed: dict[int, tuple[int, int]]
    """id(param) -> (group index, entry index) of its (first) entry."""
    pieces: dict[int, list[tuple[int, int]]]
    """id(param) -> (group index, entry index) of each piece, for a parameter planned in pieces
    ([Note: fused parameters in pieces] in tiered/zero/split.py)."""
    modules: ModuleMaps
    """Per module, the groups its hooks gather (a leaf: its whole subtree's)."""
    leaves: LeafSet
    gpu_need: GpuGatherNeed
    """Bytes the schedule holds in "gpu" at its peak ([Note: the live budget])."""
    world_size: int
    grad_homes: list[str | None]
    """Per group, its gradient's home (None: frozen): [Note: a GPU-stepped gradient stays on the GPU]."""

    def shard_numel(self, i: int) -> int:
        """Elements of group `i`'s shard on each rank (its full buffer padded, then split)."""
        return padded_numel(self.planned[i].numel, self.world_size, ALIGNMENT_NUMEL) // self.world_size


def persists_by_room(cfg: TieredConfig) -> bool:
    """Whether the gpu tier's room holds more groups persistent ([Note: persistent by room]):
    residency "auto" and a gpu budget the user gave (an implicit one would take the activations'
    room; "host" leaves a given one's room to them too)."""
    gpu = cfg.tiered.tiers.get("gpu")
    return cfg.tiered.residency == "auto" and gpu is not None and gpu.budget_bytes is not None


def plan_layout(
    model: nn.Module,
    z: ZeroConfig,
    *,
    gpu_budget_bytes: int | None,
    compute_dtype: torch.dtype,
    world_size: int,
    param_tier: str,
    grad_tier: str,
    persist_by_room: bool = False,
    accumulation: int = 1,
    gpu_stepped_grad_tier: str | None = None,
) -> GroupLayout:
    """Plan `model`'s groups under `z` and check they can be gathered (CapacityError / ConfigError
    before any partition is written). See [Note: group planning], [Note: the live budget]; with
    `persist_by_room` (a gpu budget the user gave, residency on) the budget's room holds more
    groups persistent ([Note: persistent by room]), `accumulation` micro-batches a step;
    `gpu_stepped_grad_tier` the gradients' home of the groups the GPU kernel steps (default
    `grad_tier`: [Note: a GPU-stepped gradient stays on the GPU] in tiered/optim/placement.py)."""
    leaf_names = find_leaf_modules(model, z.leaf_module)  # [Note: leaf modules]
    planned = plan_model_groups(
        model,
        z,
        gpu_budget_bytes=gpu_budget_bytes,
        compute_dtype=compute_dtype,
        world_size=world_size,
        leaves=tuple(leaf_names),
    )
    managed: dict[int, tuple[int, int]] = {}
    for i, pg in enumerate(planned):
        for j, (_, p) in enumerate(pg.params):
            managed.setdefault(id(p), (i, j))
    pieces = split_params([[p for _, p in pg.params] for pg in planned])

    def groups_of(params: Iterable[nn.Parameter]) -> list[int]:
        return groups_of_params(params, managed, pieces)

    modules = map_modules(model, groups_of)
    leaves = LeafSet(
        model, leaf_names, [pg.leaf for pg in planned], [pg.trainable for pg in planned], groups_of
    )
    for mid, leaf in leaves.by_module.items():  # entering a leaf gathers its whole subtree
        modules.groups[mid] = leaf.groups
    ws = world_size
    homes = grad_homes(
        [padded_numel(pg.numel, ws, ALIGNMENT_NUMEL) // ws for pg in planned],
        [pg.trainable for pg in planned],
        grad_tier,
        float(z.offload_optimizer.ratio),
        gpu_stepped_grad_tier,
    )
    module_groups = [(modules.names[mid], idxs) for mid, idxs in modules.groups.items()]
    itemsize = torch.empty(0, dtype=compute_dtype).element_size()
    joints = [  # the whole buffer a parameter in pieces is put together in ([Note: fused parameters in pieces])
        ({i for i, _ in where}, planned[where[0][0]].params[where[0][1]][1].numel())
        for where in pieces.values()
    ]
    joint_numel = [sum(n for gs, n in joints if gs <= set(idxs)) for _, idxs in module_groups]

    def need(budget: int | None) -> GpuGatherNeed:
        return check_gather_budgets(
            [
                PlannedSize(pg.numel, padded_numel(pg.numel, ws, ALIGNMENT_NUMEL), pg.persistent)
                for pg in planned
            ],
            module_groups,
            joint_numel=joint_numel,
            max_live=z.max_live_parameters_numel,
            gpu_budget_bytes=budget,
            param_itemsize=itemsize,
            world_size=ws,
            param_tier=param_tier,
            grad_homes=homes,
            needs_fetch=ws > 1 or param_tier != "gpu",
        )

    if persist_by_room and gpu_budget_bytes is not None and (ws > 1 or param_tier != "gpu"):
        _persist_by_room(planned, need, gpu_budget_bytes, z, itemsize, ws, accumulation)
    gpu_need = need(gpu_budget_bytes)
    return GroupLayout(
        planned, list(leaf_names), managed, pieces, modules, leaves, gpu_need, world_size, homes
    )


def _persist_by_room(
    planned: list[PlannedGroup],
    need: Callable[[int | None], GpuGatherNeed],
    budget: int,
    z: ZeroConfig,
    itemsize: int,
    world_size: int,
    accumulation: int,
) -> None:
    """Mark more of `planned` persistent while the gpu budget has room: [Note: persistent by room]."""
    per_full = (1 + 1 / world_size) if world_size > 1 else 1

    def live_bytes() -> int:  # what stage3_max_live_parameters keeps gathered beyond the gather
        gathered = sum(
            padded_numel(pg.numel, world_size, ALIGNMENT_NUMEL) for pg in planned if not pg.persistent
        )
        return int(min(z.max_live_parameters_numel, gathered) * itemsize * per_full)

    def slack() -> int:  # the budget's bytes left with the groups persistent so far
        n = need(None)
        return budget - n.total_bytes - max(0, live_bytes() - n.gather_bytes)

    if slack() < 0:
        return  # no room beyond the working set (the budget's own refusal comes after)
    gathered = [i for i, pg in enumerate(planned) if not pg.persistent]
    rereads = {
        gathered[j]
        for j in backward_rereads(
            [planned[i].numel for i in gathered],
            [False] * len(gathered),
            z.max_live_parameters_numel,
            z.max_reuse_distance_numel,
        )
    }
    a = max(1, int(accumulation))
    candidates = []
    for i in gathered:
        pg = planned[i]
        saved = a * (2 if i in rereads else 1) - (1 if pg.trainable else 0)
        if saved > 0 and pg.leaf is None:
            candidates.append((-saved, -pg.numel, i))
    order = [i for _, _, i in sorted(candidates)]

    def mark(k: int) -> None:
        for j, i in enumerate(order):
            planned[i].persistent = j < k

    # the longest prefix that fits, by bisection (each need() is a pass over the model), then
    # first fit over the rest: a smaller group still taken after a larger one did not fit
    lo, hi = 0, len(order)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mark(mid)
        lo, hi = (mid, hi) if slack() >= 0 else (lo, mid - 1)
    mark(lo)
    failed = planned[order[lo]].numel if lo < len(order) else 0
    for i in order[lo + 1 :]:
        if planned[i].numel >= failed:
            continue  # the bytes a group adds grow with its size: one as large did not fit
        planned[i].persistent = True
        if slack() < 0:
            planned[i].persistent = False
            failed = planned[i].numel
