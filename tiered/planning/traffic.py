"""Bytes per optimizer step on each link: the floor the engine's data path can reach.

[Note: bytes per step]
Per rank and optimizer step, with A = gradient_accumulation_steps micro-batches, p the compute
dtype's bytes (2 bf16/fp16, 4 fp32), S the elements of the non-persistent groups' shards, S_t
of the trainable ones, S_c of the trainable groups stepped by the CPU kernel (the others, by
``offload_optimizer.ratio``, step on the GPU with their state there) and K the states read from
a disk home per element (12 B: master, exp_avg, exp_avg_sq; in fp32, where [Note: fp32 master
is the parameter] makes the parameter the master, 8 B written, the master going home as the new
parameter below, but still 12 B read: the forward's copy of the parameter is not kept until
the step, so the step reads it again, except for the groups whose parameter is kept in cpu
([Note: residency] in residency.py), whose master is already there, and for the first groups the step's state prefetch takes the
master from the copy still gathered in "gpu" (`masters_live_into_step`: a device->host copy);
with a compressed
``tiered.optimizer_state_format`` the moments count at their encoded size, 2 + 2 B in bf16 and
2 x (1 + 4/256) B in int8, [Note: compressed optimizer state]). Links are named by the memory at
their ends: ``disk->host``, ``host->disk``, ``host->device``, ``device->host`` (disk is any
storage tier: nvme, stripe, ...; on a machine without CUDA "device" is host memory and the
host/device moves are memory copies):

* parameters homed off the GPU are gathered once per micro-batch: A x S x p from their home
  (``disk->device`` staged through host counts as one read on disk->host and one on
  host->device); groups whose parameter is kept in cpu ([Note: residency]: within
  ``offload_param.max_in_cpu``, [Note: max_in_cpu]) are read from host instead of disk. A backward that finds a parameter released re-reads it: the
  forward + backward trace replayed under the engine's rules (`backward_rereads`: what
  ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` keep in the gpu tier between
  a group's forward and its backward use) says which groups are read twice per micro-batch
  (a group is kept when what is gathered between its two uses, about twice the elements after
  it, is within ``stage3_max_reuse_distance``: at DeepSpeed's defaults of 1e9 elements, models
  up to ~0.5e9 parameters are read once);
* persistent groups stay gathered on the GPU: a frozen one moves nothing per step, a trainable
  one is read once per step after the step changed it (from its kept cpu copy where it has one);
* gradients leave the device as fp32 partitions: A x S_t x 4 device->host; homed on disk
  (``tiered.grad_tier``): every micro-batch writes (A x S_t x 4 host->disk), every micro-batch
  after the first reads the partial sum back ((A - 1) x S_t x 4) and the step reads it
  (S_c x 4 disk->host); a gradient kept in cpu ([Note: residency]) moves none of it. Where
  the step consumes each gradient from memory (the step overlapped
  with backward and A = 1: `grads_consumed_from_memory`, [Note: gradient consumed from memory]
  in tiered/optim/group.py) the disk sees none of it: 0 B, the floor the engine reaches:
  backward waits for the stepper rather than have the tier manager park kept gradients at home
  ([Note: backward waits instead of parking] in tiered/optim/kept_grads.py; where nothing of
  the cpu tier is left beyond that wait's bound, some may still be parked: above the floor);
* optimizer state homed on disk: K x S_c read and K x S_c written, less the tiles kept in the
  compute tier ([Note: residency]), which move nothing;
* the new parameters: S_c x p written to a disk home unless kept in cpu, or host->device to a
  GPU home; GPU-stepped groups move nothing.

So the bytes fall with the memory given: each byte a faster tier keeps removes the disk bytes
[Note: residency] counts for it, and the plan and `stats()` both take the kept set from
`plan_residency`, the engine's own.

This formula is what the engine's data path is measured against:
`Engine.stats()["bytes_per_step"]` puts it next to the bytes the tier manager counted per
step, and `tiered plan` divides it by the link bandwidths to rank configs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tiered.optim.placement import GroupPlan, master_is_param
from tiered.optim.state_format import FORMATS
from tiered.zero.rereads import backward_rereads, reread_groups

__all__ = ["LINKS", "backward_rereads", "bytes_per_step", "config_bytes_per_step", "reread_groups"]

if TYPE_CHECKING:
    from tiered.config.schema import TieredConfig
    from tiered.planning.kept_set import Residency
    from tiered.planning.needs import Prediction
    from tiered.shards import ShardGroup

LINKS = ("disk->host", "host->disk", "host->device", "device->host")


def bytes_per_step(
    groups: Sequence[ShardGroup],
    plans: Sequence[GroupPlan],
    memory: dict[str, str],
    *,
    compute_dtype: torch.dtype,
    accumulation: int,
    residency: Residency | None = None,
    state_format: str = "fp32",
    grads_from_memory: bool = False,
    max_live_numel: int | None = None,
    max_reuse_numel: int | None = None,
    backward: bool = True,
    master_prefetch_groups: int = 0,
) -> dict[str, int]:
    """The floor of [Note: bytes per step] per link; `memory` maps tier -> "device"/"host"/"disk";
    `residency` what the faster tiers keep ([Note: residency]; None: nothing); `state_format` the moments' ([Note: compressed optimizer state]); `grads_from_memory`: the
    step consumes each gradient from memory (`tiered.optim.arrivals.grads_consumed_from_memory`);
    `max_live_numel` / `max_reuse_numel`: ``stage3_max_live_parameters`` /
    ``stage3_max_reuse_distance``, which decide the backward's re-reads (None: unbounded);
    `backward` False leaves out what the forward and backward move (the parameter gathers and
    the gradients' hand-off to their home): what the optimizer step alone moves ([Note: step
    time model]); `master_prefetch_groups`: the first groups whose fp32 master the
    step may take from the copy still gathered (`masters_prefetch_groups`)."""
    fmt = FORMATS[state_format]
    p = torch.empty(0, dtype=compute_dtype).element_size()
    a = max(1, accumulation)
    out = dict.fromkeys(LINKS, 0)
    trainable = [g for g in groups if g.trainable]
    reread = reread_groups(groups, max_live_numel=max_live_numel, max_reuse_numel=max_reuse_numel)
    kept = set(residency.groups("param")) if residency is not None else set()
    kept_grads = residency.groups("grad") if residency is not None else frozenset()

    def kept_bytes(g: ShardGroup, part: str) -> int:
        return residency.kept_bytes(g.index, part) if residency is not None else 0

    disk = {t for t, m in memory.items() if m == "disk"} | {
        g.param.home for g in groups if g.param.home not in memory
    }
    live_masters = masters_live_into_step(
        groups, plans, compute_dtype, kept, reread, master_prefetch_groups, disk
    )

    def move(src: str, dst: str, n: int) -> None:
        s, d = memory.get(src, "disk"), memory.get(dst, "disk")
        if s == d or n == 0:
            return
        if s == "disk" and d == "device":  # staged through host memory
            out["disk->host"] += n
            out["host->device"] += n
        elif d == "disk" and s == "device":
            out["device->host"] += n
            out["host->disk"] += n
        else:
            out[f"{s}->{d}"] += n

    for g in groups if backward else ():
        home = g.param.home
        if home != "gpu" and (not g.persistent or g.trainable):
            reads = 1 if g.persistent else a * (2 if g.index in reread else 1)
            move("cpu" if g.index in kept else home, "gpu", reads * g.shard_numel * p)
    for g, plan in zip(trainable, plans, strict=True):
        assert g.grad is not None
        n = g.shard_numel
        grad_home = g.grad.home
        if (grads_from_memory or g.index in kept_grads) and memory.get(grad_home) == "disk":
            grad_home = "cpu"  # kept there, dirty (and dropped after the step): never on disk
        if grad_home != "gpu" and backward:
            if memory.get(grad_home) == "disk":
                move("gpu", "cpu", a * n * 4)
                move("cpu", grad_home, a * n * 4)
                move(grad_home, "cpu", (a - 1) * n * 4)
            else:
                move("gpu", grad_home, a * n * 4)
        if plan.side != "cpu":
            if grad_home != "gpu":
                move(grad_home, "gpu", n * 4)
            continue
        if memory.get(grad_home) == "disk":
            move(grad_home, plan.compute_tier, n * 4)
        # the tiles kept in the compute tier move nothing ([Note: residency])
        moments = max(0, fmt.moment_bytes(n) - kept_bytes(g, "exp_avg") - kept_bytes(g, "exp_avg_sq"))
        if master_is_param(g, plan, compute_dtype):
            # the master is read back unless kept in cpu (or still gathered when the state
            # prefetch takes it); written once, as the parameter (below)
            if g.index in live_masters:
                move("gpu", plan.compute_tier, 4 * n)
            master = 0 if g.index in kept or g.index in live_masters else 4 * n
            move(plan.state_home, plan.compute_tier, moments + master)
            move(plan.compute_tier, plan.state_home, moments)
        else:
            master = max(0, 4 * n - kept_bytes(g, "master"))
            move(plan.state_home, plan.compute_tier, moments + master)
            move(plan.compute_tier, plan.state_home, moments + master)
        if g.index not in kept:
            move(plan.stage_tier, g.param.home, n * p)
    return out


def state_prefetch_groups(cfg: TieredConfig, trainable_groups: int) -> int:
    """The groups whose optimizer state `OffloadedAdam.prefetch_states` starts reading when the
    step's backward begins: ``buffer_count`` of them, every one with ``pipeline_read``."""
    if cfg.zero.offload_optimizer.pipeline_read:
        return trainable_groups
    return min(trainable_groups, max(1, int(cfg.zero.offload_optimizer.buffer_count)))


def masters_prefetch_groups(cfg: TieredConfig, trainable_groups: int) -> int:
    """How many of the first trainable groups may have their fp32 master taken from the copy
    still gathered when the step's backward begins (`masters_live_into_step`): the state
    prefetch's (`state_prefetch_groups`), none where the step overlaps backward (each group's
    state is read as its gradients arrive, after its gathered copy was released; measured:
    tests/test_bytes_per_step.py)."""
    from tiered.optim.arrivals import overlap_step_applies

    return 0 if overlap_step_applies(cfg) else state_prefetch_groups(cfg, trainable_groups)


def masters_live_into_step(
    groups: Sequence[ShardGroup],
    plans: Sequence[GroupPlan],
    compute_dtype: torch.dtype,
    kept: set[int],
    reread: set[int],
    prefetch_groups: int,
    disk_tiers: set[str],
) -> set[int]:
    """The groups whose fp32 master (the parameter itself, [Note: fp32 master is the parameter])
    the state prefetch at the start of the step's backward takes from the copy still gathered in
    "gpu" rather than from its disk home: among the first `prefetch_groups` trainable ones,
    gathered from disk (not persistent, not kept in cpu) and not released before their backward
    use (not re-read). [Note: bytes per step] and the bench's replay both count them so."""
    trainable = [g for g in groups if g.trainable]
    return {
        g.index
        for j, (g, plan) in enumerate(zip(trainable, plans, strict=True))
        if j < prefetch_groups
        and master_is_param(g, plan, compute_dtype)
        and not g.persistent
        and g.param.home in disk_tiers
        and g.index not in kept
        and g.index not in reread
    }


def config_bytes_per_step(
    pred: Prediction, cfg: TieredConfig, *, residency: Residency | None = None, backward: bool = True
) -> dict[str, int]:
    """`bytes_per_step` of a predicted config, every setting read from `cfg` (the plan's and
    the benchmarks' one call); `residency` the kept set (default: the prediction's own)."""
    from tiered.optim.arrivals import grads_consumed_from_memory

    return bytes_per_step(
        list(pred.groups),
        list(pred.plans),
        pred.memory,
        compute_dtype=pred.placement.compute_dtype,
        accumulation=int(cfg.gradient_accumulation_steps),
        residency=pred.residency if residency is None else residency,
        state_format=cfg.tiered.optimizer_state_format,
        grads_from_memory=grads_consumed_from_memory(cfg),
        max_live_numel=cfg.zero.max_live_parameters_numel,
        max_reuse_numel=cfg.zero.max_reuse_distance_numel,
        backward=backward,
        master_prefetch_groups=masters_prefetch_groups(cfg, len(pred.plans)),
    )


def measured_per_step(
    links: dict[str, dict[str, float]], memory: dict[str, str], steps: int
) -> dict[str, float]:
    """The tier manager's link counters (``"nvme->cpu": {"bytes": ...}``), summed per link of
    [Note: bytes per step] and divided by `steps`."""
    out = dict.fromkeys(LINKS, 0.0)
    for key, v in links.items():
        src, _, dst = key.partition("->")
        s, d = memory.get(src, "disk"), memory.get(dst, "disk")
        if s == d:
            continue
        if s == "disk" and d == "device":
            out["disk->host"] += v["bytes"]
            out["host->device"] += v["bytes"]
        elif d == "disk" and s == "device":
            out["device->host"] += v["bytes"]
            out["host->disk"] += v["bytes"]
        else:
            out[f"{s}->{d}"] = out.get(f"{s}->{d}", 0.0) + v["bytes"]
    return {k: v / max(1, steps) for k, v in out.items()}
