"""Which partitions a faster tier keeps across steps: the residency plan, one function for the
engine and the planner.

[Note: residency]
A partition's *home* is where the config puts it (``offload_*.device``, ``tiered.grad_tier``:
the slowest tier it may live in); a faster tier with room keeps a copy of it across steps
([Note: kept copies] in tiered/tiers/partition.py), so the bytes a home on disk would move every
step are not moved. Which partitions are kept is decided once, here, from the groups, the
optimizer's plans and the room each tier has beyond its need, by bytes saved per step per byte
held (what [Note: bytes per step] in traffic.py counts for that partition):

* a 16-bit parameter homed on disk, kept in "cpu": its A x (1 + backward re-read) gathers read
  from memory instead of disk, and the new value the step writes is never written home: A(1+r)+1
  (a frozen one, never written: A(1+r); a persistent one, gathered once and read again only
  after each step changed it: 1+1); where the fp32 parameter is the master
  ([Note: fp32 master is the parameter]) the step's read of it as well: one more;
* an fp32 gradient homed on disk (``tiered.grad_tier``), kept in "cpu": each micro-batch's flush
  neither writes it nor reads the partial sum back, and the step does not read it: 2A; none
  where the step already consumes it from memory ([Note: gradient consumed from memory]);
* an optimizer-state tile (master, exp_avg, exp_avg_sq at their stored size) homed on disk,
  kept in the compute tier: one read and one write per step: 2.

Candidates are taken densest first (ties: parameters, then gradients, then state; then the
larger first, then execution order), each while it fits the room left, a smaller one still taken
after a larger one did not fit: first-fit decreasing, so the room left unused is less than the
smallest partition not kept. The parameters kept stay within ``offload_param.max_in_cpu`` elements (DeepSpeed's cap on
the parameters a cpu tier holds for an NVMe home, [Note: max_in_cpu]). The room of a tier is its
budget less everything else the memory model puts there (homes, the optimizer pipeline's
staging, the gradients an overlapped step keeps): `residency_room`. A tier whose budget the user
did not give (``budget`` absent: what its backend reports free) lends its room less
`IMPLICIT_RESERVE`, shared by the ranks of one host, so that what the compute and the system
still allocate (activations on a machine without a GPU, the page cache) has room.

Nothing about the values changes: a kept copy holds the same bytes its home would, written home
when it is evicted or flushed, so a run trains bitwise the same whatever is kept where
(tests/test_residency.py trains across budgets). ``tiered.residency: "off"`` keeps only what
DeepSpeed's offload keeps: the new parameters a cpu tier holds for an NVMe home, in execution order
up to ``offload_param.max_in_cpu`` elements, whatever the room (the manager writes them home when
the budget needs it); every other partition lives in its home between uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from tiered.optim.placement import GroupPlan, master_is_param, state_partition_specs
from tiered.optim.state_format import FORMATS
from tiered.planning.kept_set import KIND_ORDER, KeptPartition, Residency, TierRoom
from tiered.zero.rereads import reread_groups

if TYPE_CHECKING:
    from tiered.config.schema import TieredConfig
    from tiered.shards import ShardGroup

IMPLICIT_RESERVE_FRACTION = 0.10
IMPLICIT_RESERVE_MIN_BYTES = 2 * 2**30


def implicit_reserve_bytes(total_bytes: int | None) -> int:
    """What a tier without a user-given budget keeps free of kept copies ([Note: residency]):
    a tenth of the memory, at least 2 GiB."""
    if total_bytes is None:
        return IMPLICIT_RESERVE_MIN_BYTES
    return max(IMPLICIT_RESERVE_MIN_BYTES, int(IMPLICIT_RESERVE_FRACTION * total_bytes))


def residency_room(
    budget_bytes: int | None,
    need_bytes: int,
    *,
    explicit: bool,
    total_bytes: int | None = None,
    local_ranks: int = 1,
) -> int:
    """Bytes a tier may hold in kept copies ([Note: residency]): its budget less its need; for a
    budget the user did not give, less `implicit_reserve_bytes` and shared by the `local_ranks`
    of one host. 0 for a tier with no budget to reason about."""
    if budget_bytes is None:
        return 0
    room = budget_bytes - need_bytes
    if not explicit:
        room = (room - implicit_reserve_bytes(total_bytes)) // max(1, local_ranks)
    return max(0, int(room))


def plan_residency(
    groups: Sequence[ShardGroup],
    plans: Sequence[GroupPlan],
    memory: Mapping[str, str],
    room: Mapping[str, int],
    *,
    compute_dtype: torch.dtype,
    tile_numel: int,
    state_format: str = "fp32",
    accumulation: int = 1,
    reread: frozenset[int] | set[int] = frozenset(),
    grads_from_memory: bool = False,
    max_in_cpu_numel: int | None = None,
    enabled: bool = True,
) -> Residency:
    """The partitions each tier of `room` keeps ([Note: residency]). `groups` are every group
    (frozen ones too), `plans` one per trainable group in order; `memory` maps a tier to
    "device", "host" or "disk"; `reread` the groups the backward reads a second time
    (`tiered.zero.rereads.reread_groups`); `max_in_cpu_numel` the cap on parameter
    elements kept (None: none)."""
    if not enabled:
        return _max_in_cpu_only(groups, plans, memory, max_in_cpu_numel, dict(room))
    if not any(r > 0 for r in room.values()):
        return Residency((), dict(room))  # no tier has room: nothing to weigh
    a = max(1, int(accumulation))
    fmt = FORMATS[state_format]
    trainable = [g for g in groups if g.trainable]
    plan_of = {g.index: p for g, p in zip(trainable, plans, strict=True)}
    # (-density, kind, -size, order, k, numel): the order they are offered the room in
    candidates: list[tuple[float, int, int, int, KeptPartition, int]] = []

    def on_disk(tier: str) -> bool:
        return memory.get(tier, "disk") == "disk"

    def offer(
        part: str, name: str, g: ShardGroup, tier: str, nbytes: int, saved: int, order: int, numel: int = 0
    ) -> None:
        kind = part if part in ("param", "grad") else "state"
        if tier in room and room[tier] > 0 and nbytes > 0 and saved > 0:
            k = KeptPartition(name, kind, part, g.index, tier, int(nbytes), int(saved), not g.trainable)
            candidates.append((-saved / nbytes, KIND_ORDER[kind], -int(nbytes), order, k, numel))

    for order, g in enumerate(groups):
        plan = plan_of.get(g.index)
        # a persistent group stays gathered in "gpu": read again only after a step changed it
        if g.persistent:
            gathers = 0 if plan is None else 1
        else:
            gathers = a * (2 if g.index in reread else 1)
        param = g.param
        if on_disk(param.home):
            if plan is None:  # frozen: read by every gather, never written
                saved = gathers * param.nbytes
                offer("param", param.name, g, "cpu", param.nbytes, saved, order, g.shard_numel)
            elif plan.side == "cpu":
                alias = master_is_param(g, plan, compute_dtype)
                where = plan.compute_tier if alias else plan.stage_tier
                if memory.get(where) == "host":
                    saved = (gathers + 1 + int(alias)) * param.nbytes
                    offer("param", param.name, g, where, param.nbytes, saved, order, g.shard_numel)
        if plan is None or plan.side != "cpu":
            continue
        grad = g.grad
        assert grad is not None
        if on_disk(grad.home) and not grads_from_memory and memory.get(plan.compute_tier) == "host":
            offer("grad", grad.name, g, plan.compute_tier, grad.nbytes, 2 * a * grad.nbytes, order)
        if on_disk(plan.state_home) and memory.get(plan.compute_tier) == "host":
            for name, numel, dtype, _ in state_partition_specs(g, plan, compute_dtype, tile_numel, fmt):
                nbytes = numel * dtype.itemsize
                part = name[len(g.name) + 1 :].split(".")[0]  # "<group>.<state>[.t<index>]"
                offer(part, name, g, plan.compute_tier, nbytes, 2 * nbytes, order)
    left = {t: int(b) for t, b in room.items()}
    params_left = None if max_in_cpu_numel is None else int(max_in_cpu_numel)
    kept: list[KeptPartition] = []
    for *_, k, numel in sorted(candidates, key=lambda c: c[:4]):
        if k.nbytes > left[k.tier]:
            continue
        if k.kind == "param" and params_left is not None:
            if numel > params_left:
                continue
            params_left -= numel
        left[k.tier] -= k.nbytes
        kept.append(k)
    return Residency(tuple(kept), dict(room))


def _max_in_cpu_only(
    groups: Sequence[ShardGroup],
    plans: Sequence[GroupPlan],
    memory: Mapping[str, str],
    max_in_cpu_numel: int | None,
    room: dict[str, int],
) -> Residency:
    """``tiered.residency: "off"``: DeepSpeed's own keep ([Note: max_in_cpu]) and nothing else."""
    limit = 0 if max_in_cpu_numel is None else int(max_in_cpu_numel)
    kept, total = [], 0
    trainable = [g for g in groups if g.trainable]
    for g, plan in zip(trainable, plans, strict=True):
        n = g.shard_numel
        if plan.stage_tier == "cpu" and g.param.home not in ("cpu", "gpu") and total + n <= limit:
            total += n
            kept.append(KeptPartition(g.param.name, "param", "param", g.index, "cpu", g.param.nbytes, 0))
    return Residency(tuple(kept), room)


def config_residency(
    groups: Sequence[ShardGroup],
    plans: Sequence[GroupPlan],
    cfg: TieredConfig,
    need_bytes: Mapping[str, int],
    memory: Mapping[str, str],
    tiers: Mapping[str, TierRoom],
) -> Residency:
    """`plan_residency` for a resolved config: the room of each host tier in `tiers` (its budget
    less its need, `residency_room`; less, where an overlapped step keeps gradients there, the
    ``buffer_count`` largest of them), every other setting read from `cfg`. The engine passes
    its tier manager's budgets, the planner the memories it was given; `need_bytes` each tier's
    need (`TierNeed`'s total)."""
    from tiered.optim.arrivals import grads_consumed_from_memory
    from tiered.optim.placement import optimizer_tile_numel

    from_memory = grads_consumed_from_memory(cfg)
    depth = max(1, int(cfg.zero.offload_optimizer.buffer_count))
    kept_grads = sorted((g.grad.nbytes for g in groups if g.grad is not None), reverse=True)[:depth]
    room: dict[str, int] = {}
    for name, t in tiers.items():
        if memory.get(name) != "host":
            continue
        need = int(need_bytes.get(name, 0))
        r = residency_room(
            t.budget_bytes, need, explicit=t.explicit, total_bytes=t.total_bytes, local_ranks=t.local_ranks
        )
        if from_memory:  # [Note: backward waits instead of parking]: the kept gradients' own room
            r = max(0, r - sum(kept_grads))
        room[name] = r
    return plan_residency(
        groups,
        plans,
        memory,
        room,
        compute_dtype=cfg.precision.dtype,
        tile_numel=optimizer_tile_numel(cfg),
        state_format=cfg.tiered.optimizer_state_format,
        accumulation=int(cfg.gradient_accumulation_steps),
        reread=reread_groups(
            groups,
            max_live_numel=cfg.zero.max_live_parameters_numel,
            max_reuse_numel=cfg.zero.max_reuse_distance_numel,
        ),
        grads_from_memory=from_memory,
        max_in_cpu_numel=int(cfg.zero.offload_param.max_in_cpu_numel),
        enabled=cfg.tiered.residency != "off",
    )
