"""The I/O one training step of a model + config does on its storage tiers, derived from the
engine's own planning code: which partitions exist, how large, where they live, how often each
is read and written per step, and how many are in flight at once.

[Note: training I/O pattern]
The partitions come from the functions the engine calls at initialize, not from a formula of our
own: `plan_model_groups` (which parameters form which flat group, blocks capped by the budgets),
`padded_numel` with the engine's `ALIGNMENT_NUMEL` (each group's shard), `choose_placement` (the
home tier of parameters, gradients and optimizer state) and `plan_optimizer_placement` (which
groups step on the CPU and where their state lives). What each partition does per step follows
the engine's step (tiered/optim/offload.py, tiered/zero/group.py, tiered/zero/grad_home.py):

* optimizer state homed in a storage tier: master (unless the fp32 parameter partition is the
  master), exp_avg and exp_avg_sq are read into the compute tier and written back once per step,
  `offload_optimizer.buffer_count` groups read ahead, write-backs bounded by the same window;
* a gradient homed in a storage tier: written once by the flush in backward (one group at a
  time; the first flush after zeroing overwrites it, so it is not read first), read by the
  optimizer;
* parameters homed in a storage tier: read for the forward, again for the backward where the
  live budget evicted them in between (the engine's reuse-distance and live-budget rules replayed
  on the forward + reversed trace, `tiered.planning.traffic.backward_rereads`), and the new values written back by the
  step, except the groups kept in "cpu" by
  ``offload_param.max_in_cpu`` ([Note: max_in_cpu]), which move no storage bytes after their
  first step. Two reads are not where the forward would make them: the step prefetches the next
  forward's first groups, up to ``stage3_prefetch_bucket_size`` within the live budget, once it
  wrote them (`ZeroParameters.params_updated`; not when the step overlaps backward), and the
  state prefetch at the start of backward reads the first groups' fp32 masters (the parameter
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from tiered.units import format_bytes

if TYPE_CHECKING:
    from tiered.config.schema import TieredConfig
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
    model: nn.Module, cfg: TieredConfig, *, gpu_budget_bytes: int | None, gpu_is_host: bool
) -> TrainingPattern:
    """The storage moves of one step of `model` (meta or real) under `cfg`, on one rank.

    `gpu_budget_bytes` is the "gpu" tier's budget as the tier manager reports it (the engine caps
    blocks by it); `gpu_is_host` whether that tier is host memory (no CUDA)."""
    from tiered.engine.build import choose_placement
    from tiered.optim.placement import kept_in_cpu, plan_optimizer_placement
    from tiered.planning.traffic import backward_rereads
    from tiered.shards import padded_numel
    from tiered.zero.sharding import ALIGNMENT_NUMEL, plan_model_groups

    placement = choose_placement(cfg)
    dtype = placement.compute_dtype
    planned = plan_model_groups(
        model, cfg.zero, gpu_budget_bytes=gpu_budget_bytes, compute_dtype=dtype, world_size=1
    )
    shards = [padded_numel(pg.numel, 1, ALIGNMENT_NUMEL) for pg in planned]
    storage = {placement.param_tier, placement.grad_tier, placement.optimizer_tier} - set(MEMORY_TIERS)
    trainable = [i for i, pg in enumerate(planned) if pg.trainable]
    # plan_optimizer_placement reads only shard_numel and param.home of each group
    standins = [
        SimpleNamespace(shard_numel=shards[i], param=SimpleNamespace(home=placement.param_tier))
        for i in trainable
    ]
    plans = plan_optimizer_placement(
        cast("Sequence[ShardGroup]", standins), cfg, placement.optimizer_tier, gpu_is_host=gpu_is_host
    )
    kept = kept_in_cpu(
        [shards[i] for i in trainable],
        [placement.param_tier] * len(trainable),
        plans,
        cfg.zero.offload_param.max_in_cpu_numel,
    )
    moving = [j for j in range(len(trainable)) if placement.param_tier in storage and j not in kept]
    reread = backward_rereads(
        [shards[trainable[j]] for j in moving],
        [planned[trainable[j]].persistent for j in moving],
        cfg.zero.max_live_parameters_numel,
        cfg.zero.max_reuse_distance_numel,
    )
    prefetched = _after_step_prefetch(cfg, planned, shards)
    state_prefetch = (
        len(trainable)
        if cfg.zero.offload_optimizer.pipeline_read
        else min(len(trainable), max(1, int(cfg.zero.offload_optimizer.buffer_count)))
    )
    live_into_step: set[str] = set()
    after_step: set[str] = set()
    parts: list[PartitionIO] = []
    notes: list[str] = []
    fp32 = torch.float32
    for j, (i, plan) in enumerate(zip(trainable, plans, strict=True)):
        name, n = f"g{i:04d}", shards[i]
        alias = dtype == fp32 and plan.side == "cpu" and placement.param_tier == plan.state_home
        if plan.state_home in storage and plan.state_home != plan.compute_tier:
            states = ("exp_avg", "exp_avg_sq") if alias else ("master", "exp_avg", "exp_avg_sq")
            for s in states:
                parts.append(
                    PartitionIO(f"{name}.{s}", n, fp32, plan.state_home, plan.compute_tier, "step", 1, 1)
                )
        if placement.grad_tier in storage:
            # one backward per step: its flush overwrites the zeroed gradient (allocated, not read)
            parts.append(PartitionIO(f"{name}.grad", n, fp32, placement.grad_tier, "cpu", "backward", 0, 1))
            parts.append(PartitionIO(f"{name}.grad", n, fp32, placement.grad_tier, "cpu", "step", 1, 0))
        if placement.param_tier in storage and j not in kept:
            parts.append(PartitionIO(f"{name}.param", n, dtype, placement.param_tier, "gpu", "forward", 1, 0))
            if i in prefetched:
                after_step.add(f"{name}.param")
            if moving.index(j) in reread:
                parts.append(
                    PartitionIO(f"{name}.param", n, dtype, placement.param_tier, "gpu", "backward", 1, 0)
                )
            elif alias and j < state_prefetch and not planned[i].persistent:
                # still live in "gpu" when backward begins and the step's state prefetch reads the
                # master (the parameter itself): from that copy, not from storage
                live_into_step.add(f"{name}.param")
            # the step writes the new values back; where the parameter is the master it reads it too
            stage = plan.compute_tier if alias else plan.stage_tier
            parts.append(
                PartitionIO(f"{name}.param", n, dtype, placement.param_tier, stage, "step", int(alias), 1)
            )
    frozen = len(planned) - len(trainable)
    if frozen and placement.param_tier in storage:
        notes.append(f"{frozen} frozen groups: their parameter reads are not replayed")
    if kept and placement.param_tier in storage:
        notes.append(
            f"{len(kept)} of {len(trainable)} parameter groups stay in cpu (offload_param.max_in_cpu): "
            "no storage I/O after the first step"
        )
    return TrainingPattern(
        model_params=sum(p.numel() for p in model.parameters()),
        groups=len(planned),
        placement=placement.describe(cfg),
        partitions=tuple(parts),
        buffer_count=max(1, int(cfg.zero.offload_optimizer.buffer_count)),
        link_bound=link_bound(),
        storage_tiers=tuple(sorted(storage)),
        notes=tuple(notes),
        prefetch_groups=state_prefetch,
        live_into_step=frozenset(live_into_step),
        after_step_prefetch=frozenset(after_step),
    )


def _after_step_prefetch(cfg: TieredConfig, planned: Sequence[Any], shards: list[int]) -> set[int]:
    """The groups (by index) the engine prefetches after a step for the next forward: the first
    ones of the forward until ``prefetch_bucket_size`` elements are covered (the trace's
    `upcoming`), as long as they fit the live budget (persistent groups do not count in it).
    None where the step overlaps backward (the engine prefetches only between passes)."""
    from tiered.optim.arrivals import overlap_step_applies

    if overlap_step_applies(cfg):
        return set()
    out: set[int] = set()
    total = live = 0
    for i, pg in enumerate(planned):  # forward order: the groups are planned in module order
        if total >= cfg.zero.prefetch_bucket_size_numel:
            break
        if not pg.persistent:
            if live + shards[i] > cfg.zero.max_live_parameters_numel:
                break
            live += shards[i]
        out.add(i)
        total += shards[i]
    return out
