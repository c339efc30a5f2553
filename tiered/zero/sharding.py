"""Turning a model into shard groups, once, at initialize: plan the groups, check the budgets,
write each group's partitions into the TierManager and leave the parameters empty.

Everything here runs only while `ZeroParameters` is built; what it returns is owned by the
coordinator (the module maps) and the group runtimes (the groups and their parameters). The
layout is [Note: flat shard groups] (tiered/shards.py), the grouping [Note: group planning]
(tiered/zero/plan.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tiered.shards import ParamEntry, ShardGroup, group_name, padded_numel
from tiered.zero.meta import drop_meta_storage, materialize_buffers, materialize_group
from tiered.zero.plan import PlannedGroup, flat_fp32, plan_param_groups

if TYPE_CHECKING:
    from tiered.config.schema import ZeroConfig
    from tiered.tiers import TierManager
    from tiered.zero.load import LoadPlan

ALIGNMENT_NUMEL = 64
"""Shards start at multiples of 64 elements (128 B in bf16, 256 B in fp32)."""


def plan_model_groups(
    model: nn.Module,
    z: ZeroConfig,
    *,
    gpu_budget_bytes: int | None,
    compute_dtype: torch.dtype,
    world_size: int,
    leaves: tuple[str, ...] = (),
) -> list[PlannedGroup]:
    """The model's groups, blocks capped so that two fit the budgets (see [Note: group planning])."""
    # A block is one group only while two of them (the current and the prefetched next) fit
    # the live budget and a quarter of the gpu tier: see [Note: group planning].
    block_cap = min(z.sub_group_size_numel, z.max_live_parameters_numel // 2)
    if gpu_budget_bytes is not None:
        itemsize = torch.empty(0, dtype=compute_dtype).element_size()
        block_cap = min(block_cap, gpu_budget_bytes // (4 * itemsize) * world_size)
    return plan_param_groups(
        model,
        sub_group_size_numel=z.sub_group_size_numel,
        param_persistence_threshold_numel=z.param_persistence_threshold_numel,
        model_persistence_threshold_numel=z.model_persistence_threshold_numel,
        max_block_numel=block_cap,
        leaves=leaves,
    )


@dataclass
class ModuleMaps:
    """Per module (by id): the groups its hooks gather, its name, its direct parameters."""

    groups: dict[int, list[int]]
    """id(module) -> indices of the groups holding its direct parameters."""
    names: dict[int, str]
    """id(module) -> qualified name (the root: its class name), for messages."""
    params: dict[int, frozenset[int]]
    """id(module) -> ids of its direct parameters at initialize (to detect replaced ones)."""


def own_param_ids(m: nn.Module) -> frozenset[int]:
    """Ids of `m`'s direct parameters, counting one that torch's parametrize moved under
    ``m.parametrizations[name].original`` while a parametrization is registered (peft's LoRA
    on a fused expert parameter registers one for the length of each forward): the same
    parameter, not a replaced one."""
    ids = {id(p) for p in m.parameters(recurse=False)}
    plists = getattr(m, "parametrizations", None)
    if isinstance(plists, nn.ModuleDict):
        for plist in plists.values():
            ids.update(id(p) for p in plist.parameters(recurse=False))
    return frozenset(ids)


def map_modules(model: nn.Module, groups_of: Callable[[Iterable[nn.Parameter]], list[int]]) -> ModuleMaps:
    """Per module the groups holding its direct parameters (`groups_of`: every piece of a
    parameter in pieces, [Note: fused parameters in pieces])."""
    maps = ModuleMaps({}, {}, {})
    for mname, m in model.named_modules():
        maps.groups[id(m)] = groups_of(m.parameters(recurse=False))
        maps.names[id(m)] = mname or type(m).__name__
        maps.params[id(m)] = own_param_ids(m)
    return maps


@dataclass
class WrittenGroup:
    """One group whose partitions exist; its parameters now point at the placeholder."""

    group: ShardGroup
    params: list[nn.Parameter]
    initial_fp32: torch.Tensor | Callable[[], torch.Tensor] | None
    """This rank's fp32 shard where the partition cannot give it back exactly (low precision, meta);
    with a weights source, a function reading it again from the files ([Note: streaming load])."""


def write_group_partitions(
    model: nn.Module,
    planned: list[PlannedGroup],
    tm: TierManager,
    *,
    param_tier: str,
    grad_homes: Sequence[str | None],
    compute_dtype: torch.dtype,
    world_size: int,
    rank: int,
    is_meta: bool,
    placeholder: torch.Tensor,
    weights: LoadPlan | None = None,
) -> list[WrittenGroup]:
    """Create each group's param (and grad) partition from the model's values, one group at a
    time (a meta model is materialised group by group: see [Note: meta materialisation]); with
    `weights`, from the files instead ([Note: streaming load])."""
    if is_meta:
        # Buffers first, while every parameter is still meta: a module's init computes its buffers
        # (Gemma's embed_scale) and also writes its parameters (zeroes the padding row), which on a
        # meta parameter is a no-op; later the parameters are placeholders without their shape.
        materialize_buffers(model, torch.device("cpu"))
    sizes = []
    pieces_left: dict[int, int] = {}  # a parameter in pieces keeps its values until its last piece is written
    for pg in planned:
        full = padded_numel(pg.numel, world_size, ALIGNMENT_NUMEL)
        sizes.append((full, full // world_size))
        for _, p in pg.params:
            pieces_left[id(p)] = pieces_left.get(id(p), 0) + 1
    if weights is not None:  # before anything is written
        cpu_budget = tm.budget_bytes("cpu") if "cpu" in tm.tier_names else None
        weights.check_buffers_fit([s for _, s in sizes], compute_dtype, cpu_budget)
        weights.pin = placeholder.device.type == "cuda" and param_tier == "gpu"
    out = []
    for i, (pg, (full, shard)) in enumerate(zip(planned, sizes, strict=True)):
        name = group_name(i)
        entries, off = [], 0
        for qual, p, start, n in pg.slots():
            entries.append(ParamEntry(qual, off, n, tuple(p.shape), start))
            off += n
        init32: torch.Tensor | Callable[[], torch.Tensor] | None = None
        if weights is not None:

            def init_missing(todo: list[tuple[str, nn.Parameter]]) -> None:
                materialize_group(model, todo, torch.device("cpu"))

            shard32 = weights.fill_shard(pg.slots(), rank * shard, shard, init_missing)
            if pg.trainable and compute_dtype != torch.float32:
                covered = all(id(p) in weights.source_of for _, p in pg.params)
                init32 = weights.initial_fp32(pg.slots(), rank * shard, shard) if covered else shard32.clone()
        else:
            if is_meta:
                materialize_group(model, pg.params, torch.device("cpu"))
            flat = flat_fp32(pg.slots(), full)
            shard32 = flat[rank * shard : (rank + 1) * shard]
            del flat
            if pg.trainable and (compute_dtype != torch.float32 or is_meta):
                init32 = shard32.clone()
        # for a CUDA gpu tier the pinned fp32 buffer goes to the device and is cast there
        src = (
            shard32.to(placeholder.device, non_blocking=True)
            if weights is not None and weights.pin
            else shard32
        )
        ppart = tm.create(f"{name}.param", shard, compute_dtype, param_tier, init=src.to(compute_dtype))
        grad_home = grad_homes[i]  # [Note: a GPU-stepped gradient stays on the GPU]
        gpart = tm.create(f"{name}.grad", shard, torch.float32, grad_home) if grad_home is not None else None
        del shard32
        g = ShardGroup(i, name, tuple(entries), full, shard, rank * shard, ppart, gpart, pg.persistent)
        params = [p for _, p in pg.params]
        for p in params:
            pieces_left[id(p)] -= 1
            if pieces_left[id(p)]:
                continue  # its other pieces are read from it in the next groups
            if p.is_meta:  # never materialised (its values came from the files): give it host storage
                drop_meta_storage(p)
            p.data = placeholder
        out.append(WrittenGroup(g, params, init32))
    return out


def move_buffers(model: nn.Module, device: torch.device, *, is_meta: bool) -> None:
    """Buffers (rotary tables, masks) live where compute runs; meta ones get storage first."""
    if is_meta:
        materialize_buffers(model, device)
    for b_mod in model.modules():
        for bname, buf in list(b_mod._buffers.items()):
            if buf is not None and buf.device != device:
                b_mod._buffers[bname] = buf.to(device)
