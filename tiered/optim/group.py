"""One trainable shard group as the offloaded optimizer sees it: its plan, its partitions, its
step counts, this step's received mask, and the tier protocol that moves them (the pipeline in
tiered/optim/offload.py only orders the groups).

Lifetime: the engine's. An `OptimGroup` is made once at initialize, when its state partitions
are created, and lives until the engine closes; the mask is the only per-step field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from tiered.optim.placement import GroupPlan, StatePartitions, state_partition_specs
from tiered.optim.runs import GroupSteps, ParamHyper, Run
from tiered.shards import ShardGroup

if TYPE_CHECKING:
    from tiered.tiers import Partition, TierFuture, TierManager


class OptimGroup:
    """The optimizer's side of one trainable `ShardGroup`. See [Note: sub-group pipeline]."""

    def __init__(
        self,
        tm: TierManager,
        group: ShardGroup,
        plan: GroupPlan,
        hypers: Sequence[ParamHyper],
        initial_fp32: torch.Tensor,
        *,
        compute_dtype: torch.dtype,
        keep_in_cpu: bool,
    ) -> None:
        """Create `group`'s state partitions (the specs the engine's capacity check counted),
        the master filled from `initial_fp32` (its fp32 shard)."""
        if group.grad is None:
            raise ValueError(
                f"OffloadedAdam steps trainable groups only; group {group.name} is frozen (no gradient)"
            )
        self.tm = tm
        self.group = group
        self.plan = plan
        self.grad: Partition = group.grad
        """Its fp32 gradient partition (zero's; read by the step, never written by it)."""
        self.steps = GroupSteps(group, hypers)
        """Its entries' own step counts and the runs of its shard."""
        self.keep_in_cpu = keep_in_cpu
        """The new parameter stays in "cpu" after the step ([Note: max_in_cpu])."""
        master = initial_fp32.to(torch.float32).reshape(-1)
        if master.numel() != group.shard_numel:
            raise ValueError(
                f"initial fp32 shard of group {group.name} has {master.numel()} elements, "
                f"expected shard_numel={group.shard_numel}"
            )
        specs = state_partition_specs(group, plan, compute_dtype)
        self.param_is_master = len(specs) == 2
        """[Note: fp32 master is the parameter]: the param partition is the master."""
        made = [
            tm.create(name, numel, dtype, home, init=master if name.endswith(".master") else None)
            for name, numel, dtype, home in specs
        ]
        del master
        self.states = StatePartitions(group.param, *made) if self.param_is_master else StatePartitions(*made)
        """Its master / exp_avg / exp_avg_sq partitions."""
        self._received = False
        self._mask: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def shard_numel(self) -> int:
        return self.group.shard_numel

    # ---- this step's received set: [Note: parameters without a gradient are not stepped] ----
    def receive(self, mask: torch.Tensor | None) -> bool:
        """Record which entries got a gradient this step (None: all); False if none did."""
        self._received, self._mask = True, mask
        return mask is None or bool(mask.any())

    @property
    def received(self) -> bool:
        """Its received set of this step is recorded (`receive` was called)."""
        return self._received

    def runs(self) -> list[Run]:
        """The shard's runs for this step's received set."""
        return self.steps.runs(self._mask)

    def advance(self) -> None:
        """The step is done: entries that got no gradient (all, if never received) fall behind."""
        received = self._mask if self._received else torch.zeros(len(self.group.entries), dtype=torch.uint8)
        self.steps.advance(received)
        self._received, self._mask = False, None

    # ---- the tier protocol ---------------------------------------------------------------
    def own_partitions(self) -> list[Partition]:
        """The partitions this group's optimizer owns (the parameter's is zero's, even as master)."""
        return [p for p in self.states if p is not self.group.param]

    def prefetch_bytes(self) -> int:
        """Bytes `prefetch` would bring into the compute tier (0: the states live there)."""
        if self.plan.state_home == self.plan.compute_tier:
            return 0
        return sum(p.nbytes for p in self.states)

    def prefetch(self) -> list[TierFuture]:
        """Start reading the states into the compute tier, unpinned ([Note: pipeline_read])."""
        return [self.tm.prefetch(p, self.plan.compute_tier) for p in self.states]

    def issue_reads(self) -> list[TierFuture]:
        """Fetch (pin) master, exp_avg, exp_avg_sq and the gradient into the compute tier."""
        tier = self.plan.compute_tier
        return [self.tm.fetch(p, tier) for p in self.states] + [self.tm.fetch(self.grad, tier)]

    def staging_buffer(self) -> torch.Tensor | None:
        """A pinned buffer for the new compute-dtype parameter in the stage tier (None where the
        master is the parameter and is updated in place)."""
        if self.param_is_master:
            return None
        return self.tm.allocate(self.group.param, self.plan.stage_tier).result()

    def issue_writes(self) -> list[TierFuture]:
        """After the update: the states dirty where they changed, everything unpinned, what was
        staged away from home evicted (a write-back when home is slower); the futures."""
        plan, tm, futs = self.plan, self.tm, []
        param = self.group.param
        for part in self.own_partitions():
            if not (plan.compute_tier == plan.state_home and part.valid_in() == {plan.state_home}):
                # (an in-place update of the only copy, at home in memory, needs no bookkeeping)
                tm.mark_dirty(part, plan.compute_tier)
            tm.release(part, plan.compute_tier)
            if plan.compute_tier != plan.state_home:
                futs.append(tm.evict(part, plan.compute_tier))
        tm.release(self.grad, plan.compute_tier)
        if plan.compute_tier != self.grad.home:
            futs.append(tm.evict(self.grad, plan.compute_tier))  # clean: free
        # the new parameter: in the staging tier, or (alias) in the compute tier the master came to
        new_in = plan.compute_tier if self.param_is_master else plan.stage_tier
        if self.param_is_master and not (new_in == param.home and param.valid_in() == {new_in}):
            tm.mark_dirty(param, new_in)
        tm.release(param, new_in)
        if new_in != param.home and not self.keep_in_cpu:  # see [Note: max_in_cpu]
            futs.append(tm.evict(param, new_in))
        return futs

    # ---- checkpoints and tests -----------------------------------------------------------
    def master_shard(self) -> torch.Tensor:
        """A host copy of its fp32 master shard."""
        part, tier = self.states.master, self.plan.compute_tier
        t = self.tm.fetch(part, tier).result()
        try:
            return t.detach().to("cpu", copy=True)
        finally:
            self.tm.release(part, tier)

    def checkpoint_partitions(self) -> dict[str, Partition]:
        """{"master", "exp_avg", "exp_avg_sq": Partition}; "master" is the parameter partition
        where that is the master."""
        return self.states._asdict()

    def param_step_counts(self, step_count: int) -> dict[str, int]:
        return self.steps.steps(step_count)

    def load_param_step_counts(self, counts: Mapping[str, int], step_count: int) -> None:
        self.steps.load_steps(counts, step_count)


def params_kept_in_cpu(
    groups: Sequence[ShardGroup], plans: Sequence[GroupPlan], max_in_cpu_numel: int
) -> list[bool]:
    """Per group: its new parameter, staged in "cpu" away from a slower home, stays there
    (within `max_in_cpu_numel` elements, in execution order). See [Note: max_in_cpu]."""
    keep, total = [], 0
    for g, p in zip(groups, plans, strict=True):
        kept = (
            p.stage_tier == "cpu"
            and g.param.home not in ("cpu", "gpu")
            and total + g.shard_numel <= max_in_cpu_numel
        )
        keep.append(kept)
        total += g.shard_numel if kept else 0
    return keep
