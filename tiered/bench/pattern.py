"""The I/O one training step of a model + config does on its storage tiers, derived from the
engine's own planning code: which partitions exist, how large, where they live, how often each
is read and written per step, and how many are in flight at once.

[Note: training I/O pattern]
The partitions come from the functions the engine calls at initialize, not from a formula of our
own: the groups `tiered.planning.needs.groups_and_plans` plans (`plan_layout`, the ZeRO-3
scheduler's planner, with the gpu tier's budget; the stand-ins `tiered plan` weighs),
`plan_optimizer_placement` (which groups step on the CPU and where their state lives) and
`state_partition_specs` (the state partitions `OptimGroup` creates: one per ``sub_group_size``
tile, the moments at their encoded size). How often each is read and written per step is
[Note: bytes per step]'s rule, from the same helpers (`kept_and_reread`,
`masters_live_into_step`, `grads_consumed_from_memory`), so the replay moves exactly the
bytes `tiered plan` predicts and `stats()` holds the engine to (tests/test_cli_bench_training.py
holds the two equal over precision x accumulation x overlap x homes x state format):

* optimizer state homed in a storage tier: master (unless the fp32 parameter partition is the
  master), exp_avg and exp_avg_sq, tile by tile, are read into the compute tier and written
  back once per step, `offload_optimizer.buffer_count` units read ahead, write-backs bounded by
  the same window;
* a gradient homed in a storage tier: written by every micro-batch's flush in backward (one
  group at a time; the first flush after zeroing overwrites it, so it is not read first; each
  later one reads it to add), read by the optimizer; none of it where the step overlaps
  backward and consumes each gradient from memory;
* parameters homed in a storage tier: read for every micro-batch's forward, again for its
  backward where the live budget evicted them in between (the engine's reuse-distance and
  live-budget rules replayed on the forward + reversed trace,
  `tiered.planning.traffic.backward_rereads`), frozen ones too, and the new values written
  back by the step, except the groups kept in "cpu" by ``offload_param.max_in_cpu`` ([Note:
  max_in_cpu]), which move no storage bytes after their first step. Two reads are not where
  the forward would make them: the step prefetches the next forward's first groups, up to
  ``stage3_prefetch_bucket_size`` within the live budget, once it wrote them
  (`ZeroParameters.params_updated`; not when the step overlaps backward), and the state
  prefetch at the start of backward reads the first groups' fp32 masters (the parameter
  itself) from their copies still live in "gpu", not from storage (`after_step_prefetch`,
  `live_into_step`).

Every move also passes the tier manager's per-link bound (`max_inflight_per_link`, 4), so the
concurrency a link sees is the smaller of that and what the pipeline asks. The replay
(`tiered.bench.training`) issues exactly these moves through a TierManager built by the
engine's `build_tier_manager` from the same config, so the backend, its swap mode (in place, no
fsync), the per-partition checksums and the link accounting ([Note: link busy time]) are the
ones training uses; `--check` compares the figure with `engine.stats()` of a real run.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tiered.units import format_bytes

if TYPE_CHECKING:
    from tiered.config.schema import TieredConfig
    from tiered.planning.residency import TierRoom
    from tiered.shards import ShardGroup

MEMORY_TIERS = ("gpu", "cpu")


def link_bound() -> int:
    """The tier manager's per-link bound on moves in flight (its constructor's default, which
    `build_tier_manager` keeps): read from there so the replay follows if it changes."""
    from tiered.tiers import TierManager

    return int(inspect.signature(TierManager.__init__).parameters["max_inflight_per_link"].default)


@dataclass(frozen=True)
class PartitionIO:
    """One partition and what a training step does with it on its storage home."""

    name: str
    numel: int
    dtype: torch.dtype
    home: str
    stage: str
    """The memory tier it is read into."""
    phase: str
    """"forward", "backward" or "step": when in the step it moves."""
    reads: int
    writes: int

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class TrainingPattern:
    """Per step: every storage-tier move of one model + config. See [Note: training I/O pattern]."""

    model_params: int
    groups: int
    placement: str
    partitions: tuple[PartitionIO, ...]
    buffer_count: int
    link_bound: int
    storage_tiers: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    prefetch_groups: int = 0
    """Groups whose optimizer state the engine starts reading when backward begins
    (`OffloadedAdam.prefetch_states`: buffer_count, or every group with pipeline_read)."""
    live_into_step: frozenset[str] = frozenset()
    """Parameter partitions (fp32, the parameter is the master) of the groups whose states the
    engine prefetches when backward begins and that are still live in "gpu" then (not evicted
    between their forward and backward uses): that prefetch reads their master from the "gpu"
    copy (a memory link), not from storage. The replay keeps them there after the forward."""
    after_step_prefetch: frozenset[str] = frozenset()
    """Parameter partitions the step prefetches into "gpu" for the next forward once it wrote
    them (`ZeroParameters.params_updated`): those reads happen at the end of the step, not in
    the forward, which then finds them resident."""
    micro_batches: int = 1
    """``gradient_accumulation_steps``: forward + backward passes per step; each partition's
    `reads` / `writes` count all of them."""

    def predicted_bytes(self) -> dict[str, int]:
        """Bytes per step per link ("nvme->cpu", ...)."""
        out: dict[str, int] = {}
        for p in self.partitions:
            if p.reads:
                src = "gpu" if p.phase == "step" and p.name in self.live_into_step else p.home
                k = f"{src}->{p.stage}"
                out[k] = out.get(k, 0) + p.reads * p.nbytes
            if p.writes:
                k = f"{p.stage}->{p.home}"
                out[k] = out.get(k, 0) + p.writes * p.nbytes
        return out

    def size_range(self) -> tuple[int, int]:
        sizes = [p.nbytes for p in self.partitions] or [0]
        return min(sizes), max(sizes)

    def describe(self) -> str:
        lo, hi = self.size_range()
        moved = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(self.predicted_bytes().items()))
        return (
            f"{self.model_params:,} parameters in {self.groups} groups; {self.placement}; "
            f"{len(self.partitions)} partitions on storage ({format_bytes(lo, binary=True)} .. "
            f"{format_bytes(hi, binary=True)}); per step {moved or 'no storage I/O'}; "
            f"optimizer window {self.buffer_count} groups, at most {self.link_bound} moves per link"
        )

    def to_json(self) -> dict[str, Any]:
        lo, hi = self.size_range()
        return {
            "model_params": self.model_params,
            "groups": self.groups,
            "placement": self.placement,
            "storage_partitions": len(self.partitions),
            "partition_bytes_min": lo,
            "partition_bytes_max": hi,
            "predicted_bytes_per_step": self.predicted_bytes(),
            "buffer_count": self.buffer_count,
            "link_bound": self.link_bound,
            "storage_tiers": list(self.storage_tiers),
            "notes": list(self.notes),
        }


def derive_pattern(
    model: nn.Module,
    cfg: TieredConfig,
    *,
    gpu_budget_bytes: int | None,
    gpu_is_host: bool,
    rooms: Mapping[str, TierRoom] | None = None,
) -> TrainingPattern:
    """The storage moves of one step of `model` (meta or real) under `cfg`, on one rank.

    `gpu_budget_bytes` is the "gpu" tier's budget as the tier manager reports it (the engine caps
    blocks by it); `gpu_is_host` whether that tier is host memory (no CUDA); `rooms` the tiers'
    budgets as the engine's manager would enforce them ([Note: residency]; default: the ones the
    config states)."""
    from tiered.engine.build import choose_placement
    from tiered.optim.arrivals import grads_consumed_from_memory
    from tiered.optim.placement import master_is_param, optimizer_tile_numel, state_partition_specs
    from tiered.optim.state_format import FORMATS
    from tiered.planning.needs import groups_and_plans
    from tiered.planning.traffic import (
        masters_live_into_step,
        masters_prefetch_groups,
        reread_groups,
        state_prefetch_groups,
    )

    placement = choose_placement(cfg)
    dtype = placement.compute_dtype
    groups, plans, residency = groups_and_plans(
        model, cfg, gpu_budget_bytes=gpu_budget_bytes, gpu_is_host=gpu_is_host, rooms=rooms
    )
    storage = {placement.param_tier, placement.grad_tier, placement.optimizer_tier} - set(MEMORY_TIERS)
    trainable = [g for g in groups if g.trainable]
    plan_of = {g.index: plan for g, plan in zip(trainable, plans, strict=True)}
    reread = reread_groups(
        groups,
        max_live_numel=cfg.zero.max_live_parameters_numel,
        max_reuse_numel=cfg.zero.max_reuse_distance_numel,
    )
    kept = set(residency.groups("param"))  # [Note: residency]: their gathers read the cpu copy
    kept_state = residency.names()
    micro = max(1, int(cfg.gradient_accumulation_steps))
    grads_in_memory = grads_consumed_from_memory(cfg)
    fmt = FORMATS[cfg.tiered.optimizer_state_format]
    tile = optimizer_tile_numel(cfg)
    prefetched = _after_step_prefetch(cfg, groups)
    state_prefetch = state_prefetch_groups(cfg, len(trainable))
    live_masters = masters_live_into_step(
        groups, plans, dtype, kept, reread, masters_prefetch_groups(cfg, len(trainable)), storage
    )
    live_into_step: set[str] = set()
    after_step: set[str] = set()
    parts: list[PartitionIO] = []
    notes: list[str] = []
    fp32 = torch.float32
    for g in groups:
        name, n, home = g.name, g.shard_numel, g.param.home
        plan = plan_of.get(g.index)
        alias = plan is not None and master_is_param(g, plan, dtype)
        if plan is not None and plan.state_home in storage and plan.state_home != plan.compute_tier:
            # the partitions OptimGroup creates, tile by tile, the moments at their encoded size
            for sname, numel, sdtype, shome in state_partition_specs(g, plan, dtype, tile, fmt):
                if sname not in kept_state:  # a tile the compute tier keeps moves nothing
                    parts.append(PartitionIO(sname, numel, sdtype, shome, plan.compute_tier, "step", 1, 1))
        if (
            plan is not None
            and g.grad is not None
            and g.grad.home in storage
            and not grads_in_memory
            and g.grad.name not in kept_state
        ):
            # every micro-batch's flush writes it; the first after zeroing overwrites it (allocated,
            # not read), each later one adds to it (read first); the step reads the sum
            grad_stage = plan.compute_tier if plan.side == "cpu" else "gpu"
            parts.append(
                PartitionIO(f"{name}.grad", n, fp32, g.grad.home, "cpu", "backward", micro - 1, micro)
            )
            parts.append(PartitionIO(f"{name}.grad", n, fp32, g.grad.home, grad_stage, "step", 1, 0))
        if home not in storage:
            continue
        if g.persistent and plan is not None and g.index not in kept:
            # stays gathered: read again once per step, after the step changed it
            parts.append(PartitionIO(f"{name}.param", n, dtype, home, "gpu", "forward", 1, 0))
            if g.index in prefetched:
                after_step.add(f"{name}.param")
        if not g.persistent and g.index not in kept:  # a kept group's gathers read its cpu copy
            parts.append(PartitionIO(f"{name}.param", n, dtype, home, "gpu", "forward", micro, 0))
            if g.index in prefetched:
                after_step.add(f"{name}.param")
            if g.index in reread:
                parts.append(PartitionIO(f"{name}.param", n, dtype, home, "gpu", "backward", micro, 0))
            elif g.index in live_masters:
                # still live in "gpu" when backward begins and the step's state prefetch reads the
                # master (the parameter itself): from that copy, not from storage
                live_into_step.add(f"{name}.param")
        if plan is not None and plan.side == "cpu" and g.index not in kept:
            # the step writes the new values back; where the parameter is the master it reads it too
            stage = plan.compute_tier if alias else plan.stage_tier
            parts.append(PartitionIO(f"{name}.param", n, dtype, home, stage, "step", int(alias), 1))
    if residency.kept:
        notes.append(
            f"{len(residency.kept)} partitions ({format_bytes(sum(k.nbytes for k in residency.kept))}) are "
            "kept in memory across steps ([Note: residency]): no storage I/O after their first use"
        )
    if grads_in_memory and placement.grad_tier in storage:
        notes.append("the step overlaps backward: gradients are consumed from memory, none reach storage")
    return TrainingPattern(
        model_params=sum(p.numel() for p in model.parameters()),
        groups=len(groups),
        placement=placement.describe(cfg),
        partitions=tuple(parts),
        buffer_count=max(1, int(cfg.zero.offload_optimizer.buffer_count)),
        link_bound=link_bound(),
        storage_tiers=tuple(sorted(storage)),
        notes=tuple(notes),
        prefetch_groups=state_prefetch,
        live_into_step=frozenset(live_into_step),
        after_step_prefetch=frozenset(after_step),
        micro_batches=micro,
    )


def _after_step_prefetch(cfg: TieredConfig, groups: Sequence[ShardGroup]) -> set[int]:
    """The groups (by index) the engine prefetches after a step for the next forward: the first
    ones of the forward until ``prefetch_bucket_size`` elements are covered (the trace's
    `upcoming`), as long as they fit the live budget (persistent groups do not count in it).
    None where the step overlaps backward (the engine prefetches only between passes)."""
    from tiered.optim.arrivals import overlap_step_applies

    if overlap_step_applies(cfg):
        return set()
    out: set[int] = set()
    total = live = 0
    for g in groups:  # forward order: the groups are planned in module order
        if total >= cfg.zero.prefetch_bucket_size_numel:
            break
        if not g.persistent:
            if live + g.shard_numel > cfg.zero.max_live_parameters_numel:
                break
            live += g.shard_numel
        out.add(g.index)
        total += g.shard_numel
    return out
