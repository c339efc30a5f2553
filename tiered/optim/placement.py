"""Where each trainable group's optimizer step runs and its state lives, decided once at
initialize, and the staging bytes that choice costs (what the engine's capacity check and
`OffloadedAdam` both take; see [Note: sub-group pipeline] in tiered/optim/offload.py).

[Note: twin-flow ratio]
``offload_optimizer.ratio`` splits the groups between the CPU kernel and the GPU kernel: the
``round(ratio * n)`` largest groups (ties by execution order) run on the CPU (their state on the
optimizer tier), the rest keep their state in "gpu" and run ``tiered_ext.gpu_adam_step`` there,
their gradients homed there where they would otherwise cross storage ([Note: a GPU-stepped
gradient stays on the GPU]; which groups is `tiered.shards.cpu_stepped`, which the ZeRO scheduler
reads too).
(DeepSpeed's Twin-Flow assigns the *last* fraction by index; by size is what bounds GPU memory.)

[Note: fp32 master is the parameter]
In an fp32 run the master *is* the parameter, bit for bit. When the parameter's home is also the
optimizer tier (both "cpu", or both "nvme") and the CPU kernel steps the group, the group's
parameter partition serves as its master: no second copy is kept, read, written or copied into
(on the step benchmark that removes 2 of the 7 shard-sized transfers per step: the master's read
and write). Elsewhere (bf16/fp16, or a parameter kept on the GPU while the state is offloaded)
the master is a partition of its own on the optimizer tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from tiered.config.schema import TieredConfig
from tiered.optim.arrivals import grads_consumed_from_memory
from tiered.optim.state_format import FORMATS, StateFormat
from tiered.shards import ShardGroup, cpu_stepped

if TYPE_CHECKING:
    from tiered.tiers import Partition, TierManager

STATE_SUFFIXES = ("master", "exp_avg", "exp_avg_sq")
MIN_TILE_NUMEL = 1 << 16
"""The smallest tile: one block of the CPU kernel's threads (tiered_ext: 64 Ki elements); a
smaller ``sub_group_size`` (0 means one parameter per group in DeepSpeed) would only add
partitions and round trips, not bound anything further."""
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
    """[Note: fp32 master is the parameter]: in an fp32 run whose CPU step
    finds the parameter at the state's home, the param partition is the master (no copy of its own)."""
    return compute_dtype == torch.float32 and plan.side == "cpu" and group.param.home == plan.state_home


def optimizer_tile_numel(cfg: TieredConfig) -> int:
    """Elements per tile of the optimizer pipeline: ``sub_group_size``, at least `MIN_TILE_NUMEL`.
    See [Note: sub-group pipeline]."""
    return max(int(cfg.zero.sub_group_size_numel), MIN_TILE_NUMEL)


def tile_bounds(group: ShardGroup, plan: GroupPlan, tile_numel: int) -> list[tuple[int, int]]:
    """The [start, stop) slices of `group`'s shard its step takes one at a time: tiles of
    `tile_numel` elements (the last one shorter) where its states are read from a slower home,
    else the whole shard (nothing is staged). See [Note: sub-group pipeline]."""
    n = group.shard_numel
    if tile_numel <= 0:
        raise ValueError(f"tile_numel must be positive, got {tile_numel}")
    if plan.state_home == plan.compute_tier or n <= tile_numel:
        return [(0, n)]
    return [(a, min(a + tile_numel, n)) for a in range(0, n, tile_numel)]


def decode_scratch_numel(
    groups: Sequence[ShardGroup], plans: Sequence[GroupPlan], tile_numel: int, fmt: StateFormat
) -> int:
    """Elements of each of the two fp32 tensors a compressed `fmt` decodes a tile's moments into
    ([Note: compressed optimizer state]): the largest tile of the trainable `groups` (one pair,
    reused tile after tile: the step updates one tile at a time); 0 for a lossless format, which
    updates the stored moments in place. The offloaded optimizer allocates it; the memory model
    counts it among the host bytes outside the tiers."""
    if fmt.lossless:
        return 0
    return max(
        (b - a for g, p in zip(groups, plans, strict=True) for a, b in tile_bounds(g, p, tile_numel)),
        default=0,
    )


def state_partition_specs(
    group: ShardGroup,
    plan: GroupPlan,
    compute_dtype: torch.dtype,
    tile_numel: int,
    fmt: StateFormat = FORMATS["fp32"],
) -> list[tuple[str, int, torch.dtype, str]]:
    """(name, numel, dtype, home) of each optimizer-state partition `OptimGroup` creates for
    `group`, tile by tile (`tile_bounds`; a tiled one's names end in ``.t<index>``): what it
    allocates, and what the engine's capacity check counts before it does. The moments are
    stored as `fmt` encodes them ([Note: compressed optimizer state]); the master is fp32."""
    suffixes = STATE_SUFFIXES[1:] if master_is_param(group, plan, compute_dtype) else STATE_SUFFIXES
    bounds = tile_bounds(group, plan, tile_numel)
    out = []
    for j, (a, b) in enumerate(bounds):
        for s in suffixes:
            numel, dtype = (b - a, torch.float32) if s == "master" else getattr(fmt, s).storage(b - a)
            out.append(
                (
                    f"{group.name}.{s}" + (f".t{j:04d}" if len(bounds) > 1 else ""),
                    numel,
                    dtype,
                    plan.state_home,
                )
            )
    return out


def gpu_stepped_grad_tier(cfg: TieredConfig, grad_tier: str, grad_tier_is_storage: bool) -> str:
    """The home of the fp32 gradients of the groups the GPU kernel steps: "gpu" where homing them
    in `grad_tier` would take them through storage, else `grad_tier`.

    [Note: a GPU-stepped gradient stays on the GPU]
    A group the GPU kernel steps (``offload_optimizer.ratio`` below 1) reads its gradient in
    "gpu", where backward produced it. Homed in ``tiered.grad_tier`` like the others, it goes down
    at each flush and back up for the step. Which is better is bytes saved per byte held: homed
    in "gpu" it holds 4 B per element there and saves 8 B of host<->device copies per element and
    micro-batch; the same 4 B of the GPU's room, spent on a third of an element more of the Adam
    state stepped there ([Note: the GPU's room searched]), saves 24 B / 3 = 8 B of NVMe traffic
    where the state would be on NVMe. So the gradients stay on the GPU only where they would
    otherwise cross storage too: ``tiered.grad_tier`` a storage tier (nvme) and the gradient not
    consumed from memory (`grads_consumed_from_memory`: the overlapped step without accumulation
    takes it from "cpu" and drops it, never writing it to NVMe). There they save 8 B of NVMe and
    8 B of PCIe per element and micro-batch for the 4 B; elsewhere the GPU's room is worth more as
    state (the 40B plan at 512 GB of host memory, overlapped: 37.2 s/step with them in "cpu",
    37.9 s with them in "gpu", the state they displaced moving 17 GB more on NVMe). The choice is
    made once, from the config, before any partition exists (the ZeRO scheduler homes the
    gradients; `tiered.shards.cpu_stepped` says which groups the GPU steps), and the capacity
    check, the plan's needs and the GPU room's ratio all read the homes the groups have."""
    if grad_tier == "gpu" or not grad_tier_is_storage or grads_consumed_from_memory(cfg):
        return grad_tier
    return "gpu"


def plan_optimizer_placement(
    groups: Sequence[ShardGroup], cfg: TieredConfig, optimizer_tier: str, *, gpu_is_host: bool
) -> list[GroupPlan]:
    """Where each trainable group's step runs and its state lives (CPU or GPU kernel, which
    tiers). See [Note: twin-flow ratio] and [Note: max_in_cpu]."""
    if optimizer_tier == "gpu":
        cpu_side: set[int] = set()
    else:
        cpu_side = set(cpu_stepped([g.shard_numel for g in groups], float(cfg.zero.offload_optimizer.ratio)))
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
    groups: Sequence[ShardGroup],
    plans: Sequence[GroupPlan],
    buffer_count: int,
    compute_dtype: torch.dtype,
    tile_numel: int,
    fmt: StateFormat = FORMATS["fp32"],
) -> dict[str, int]:
    """Staging bytes per tier the pipeline holds beyond the partitions' homes, at most, whatever
    the order the groups become ready in: a pure function of the trainable `groups`, their
    `plans` (one each), ``offload_optimizer.buffer_count``, the compute dtype and the tile size
    (`optimizer_tile_numel`). Per side of the step ("cpu", "gpu"), the sum of

    - tile bytes: the ``buffer_count`` largest tiles (`tile_bounds`) of 4 B x its elements per
      state read from a slower home (master, exp_avg, exp_avg_sq; the master not where the
      parameter is the master; the moments at `fmt`'s bytes); and
    - group bytes: the ``buffer_count`` largest groups of 4 B x shard_numel for a gradient not
      at home in the compute tier, plus the parameter staged whole away from its home
      (param bytes x shard_numel; 4 B where the fp32 parameter is the master, fetched into the
      compute tier),

    each term counted in the tier it is staged in (the compute tier, the stage tier). The
    pipeline keeps at most ``buffer_count`` tiles in flight, and a group's whole-group buffers
    live while one of its tiles is, so this is a bound the engine's capacity check and the step
    both hold to. See [Note: sub-group pipeline]."""
    psize = torch.tensor([], dtype=compute_dtype).element_size()
    depth = max(1, buffer_count)
    tiles: dict[str, list[int]] = {}
    whole: dict[str, list[int]] = {}
    for g, p in zip(groups, plans, strict=True):
        assert g.grad is not None, f"group {g.name} is frozen: it has no optimizer step"
        alias = master_is_param(g, p, compute_dtype)
        if p.state_home != p.compute_tier:
            tiles.setdefault(p.compute_tier, []).extend(
                (0 if alias else _FP32 * (b - a)) + fmt.moment_bytes(b - a)
                for a, b in tile_bounds(g, p, tile_numel)
            )
        grad_b = _FP32 * g.shard_numel if g.grad.home != p.compute_tier else 0
        if alias:
            param_b, param_in = (
                (_FP32 * g.shard_numel if g.param.home != p.compute_tier else 0),
                p.compute_tier,
            )
        else:
            param_b, param_in = (psize * g.shard_numel if g.param.home != p.stage_tier else 0), p.stage_tier
        # one entry per group and tier (a group's buffers in one tier live together)
        by_tier: dict[str, int] = {}
        if grad_b:
            by_tier[p.compute_tier] = by_tier.get(p.compute_tier, 0) + grad_b
        if param_b:
            by_tier[param_in] = by_tier.get(param_in, 0) + param_b
        for tier, b in by_tier.items():
            whole.setdefault(tier, []).append(b)
    need: dict[str, int] = {}
    for table in (tiles, whole):
        for tier, sizes in table.items():
            need[tier] = need.get(tier, 0) + sum(sorted(sizes, reverse=True)[:depth])
    return {t: b for t, b in need.items() if b}


def tier_is_host(tm: TierManager, name: str) -> bool:
    """Tier `name`'s memory is host memory (a "gpu" tier on a machine without one)."""
    return _tier_device(tm, name) == "cpu"


def _tier_device(tm: TierManager, name: str) -> str:
    try:
        return str(tm.tier(name).backend.capabilities.device)
    except Exception:  # noqa: BLE001 - a manager without that tier: treat it as a real device
        return "cuda"
