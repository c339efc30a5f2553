"""One trainable shard group as the offloaded optimizer sees it: its plan, its partitions, its
step counts, this step's received mask, and the tier protocol that moves them, tile by tile (the
pipeline in tiered/optim/offload.py only orders the tiles).

Lifetime: the engine's. An `OptimGroup` is made once at initialize, when its state partitions
are created, and lives until the engine closes; per step it holds only its received mask and,
from its first tile's read to its last tile's write, the whole-group reads and staging buffer.

[Note: max_in_cpu]
New parameters staged in "cpu" whose home is slower (nvme) may stay there, dirty: the next
forward gathers them with a memory copy instead of an NVMe read, and no step writes them to NVMe.
Which ones is the residency plan's choice ([Note: residency] in tiered/planning/residency.py),
within ``offload_param.max_in_cpu`` elements (DeepSpeed's knob of the same meaning, "parameter
elements to maintain in CPU memory when offloading to NVMe", default 1e9); the kept copy is an
ordinary kept copy of the tier manager ([Note: kept copies]), so when the cpu budget needs the
room it is written home and dropped (write-back); ``Engine.flush`` writes it home too. Any other
staging copy is evicted right after the step (written back and freed): every partition the step
is done with is `TierManager.settle`d, which evicts what its tier does not keep. (Until the
max_in_cpu keep the copy was written through to NVMe every step: on benchmarks/step.py that was
143 of 428 MB written per step.)

[Note: gradient consumed from memory]
With the step overlapped with backward ([Note: step overlapped with backward]: no clipping, no
fp16 overflow check) and no gradient accumulation, a group's gradient is complete, and final,
when its flush ends, and its Adam runs next. With the gradient homed in storage
(``tiered.grad_tier: "nvme"``, [Note: gradients on nvme]) the flush would write it to NVMe and
the step read it straight back: 8 B per element per step. The engine then asks zero to keep each
flushed gradient in "cpu" (`ZeroParameters.keep_flushed_grads`), dirty and unpinned; the step's
fetch finds it resident, and after the update `OptimGroup.issue_writes` drops it with
`TierManager.discard` ([Note: discarded copies] in tiered/tiers/manager.py) instead of writing
it home: the gradient is dead after the step (the next backward's first flush overwrites all of
it, [Note: lazy gradient zeroing] in tiered/zero/group.py). Exactness is untouched (the same
fp32 values, from memory instead of a round trip through a file). A kept gradient is an ordinary
dirty copy, so if the cpu budget needed its room before the step reached it (backward running
far ahead of the stepper), the manager would write it home and the step read it back
("parking"); backward therefore waits for the stepper instead, and the cpu tier evicts kept
gradients last ([Note: backward waits instead of parking] in tiered/optim/kept_grads.py). Only
gradients still dirty when their step ends count as consumed.
`stats()["grad_consumed_from_memory"]` gives the group steps and bytes saved (a write and a read
of the gradient each), ``stats()["grad_parked"]`` those parked anyway and backward's waits. With clipping the global norm must be known
before any update, and with accumulation the gradient is read again by the next micro-batch's
flush, so both keep the round trip.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from tiered.optim.placement import (
    STATE_SUFFIXES,
    GroupPlan,
    StatePartitions,
    master_is_param,
    state_partition_specs,
    tile_bounds,
)
from tiered.optim.runs import GroupSteps, ParamHyper, Run
from tiered.optim.state_format import FORMATS, StateFormat
from tiered.shards import ShardGroup

if TYPE_CHECKING:
    from tiered.optim.kept_grads import KeptGrads
    from tiered.tiers import Partition, TierFuture, TierManager


class Tile(NamedTuple):
    """One slice [start, stop) of a group's shard, stepped as one unit of the pipeline, and its
    state partitions (the master is the group's whole parameter partition where
    [Note: fp32 master is the parameter])."""

    start: int
    stop: int
    states: StatePartitions


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
        tile_numel: int,
        fmt: StateFormat = FORMATS["fp32"],
    ) -> None:
        """Create `group`'s state partitions, tile by tile (the specs the engine's capacity check
        counted), the master filled from `initial_fp32` (its fp32 shard)."""
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
        master = initial_fp32.to(torch.float32).reshape(-1)
        if master.numel() != group.shard_numel:
            raise ValueError(
                f"initial fp32 shard of group {group.name} has {master.numel()} elements, "
                f"expected shard_numel={group.shard_numel}"
            )
        self.param_is_master = master_is_param(group, plan, compute_dtype)
        """[Note: fp32 master is the parameter]: the param partition is the master."""
        self.fmt = fmt
        """How its moments are stored ([Note: compressed optimizer state])."""
        specs = iter(state_partition_specs(group, plan, compute_dtype, tile_numel, fmt))
        self.tiles: list[Tile] = []
        """Its shard's tiles in order (one, the whole shard, unless its states are staged)."""
        for a, b in tile_bounds(group, plan, tile_numel):
            made = []
            for name, numel, dtype, home in itertools.islice(specs, 2 if self.param_is_master else 3):
                init = master[a:b] if name[len(group.name) + 1 :].startswith("master") else None
                made.append(tm.create(name, numel, dtype, home, init=init))
            states = StatePartitions(group.param, *made) if self.param_is_master else StatePartitions(*made)
            self.tiles.append(Tile(a, b, states))
        del master
        self.grad_bytes_saved = 0
        """Gradient bytes neither written home nor read back ([Note: gradient consumed from memory])."""
        self.grad_consumed_steps = 0
        self.kept: KeptGrads | None = None
        """Told when a kept gradient's step is over ([Note: backward waits instead of parking])."""
        self._received = False
        self._mask: torch.Tensor | None = None
        # this step's whole-group reads (the gradient; the parameter where it is the master) and
        # staging buffer, taken by its first tile and given back by its last
        self._grad_read: TierFuture[torch.Tensor] | None = None
        self._master_read: TierFuture[torch.Tensor] | None = None
        self._out: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def shard_numel(self) -> int:
        return self.group.shard_numel

    @property
    def states(self) -> StatePartitions:
        """Its master / exp_avg / exp_avg_sq partitions (a group stepped in one tile)."""
        if len(self.tiles) != 1:
            raise ValueError(
                f"group {self.name} is stepped in {len(self.tiles)} tiles, each with its own state "
                "partitions: ask its .tiles (or checkpoint_partitions())"
            )
        return self.tiles[0].states

    # ---- this step's received set: [Note: parameters without a gradient are not stepped] ----
    def receive(self, mask: torch.Tensor | None) -> bool:
        """Record which entries got a gradient this step (None: all); False if none did."""
        self._received, self._mask = True, mask
        return mask is None or bool(mask.any())

    @property
    def received(self) -> bool:
        """Its received set of this step is recorded (`receive` was called)."""
        return self._received

    def runs(self, j: int = 0) -> list[Run]:
        """Tile `j`'s runs for this step's received set, relative to the tile."""
        runs = self.steps.runs(self._mask)
        a, b = self.tiles[j].start, self.tiles[j].stop
        if (a, b) == (0, self.shard_numel):
            return runs
        clipped = []
        for r in runs:
            lo, hi = max(r.start, a), min(r.stop, b)
            if lo < hi:
                clipped.append(r._replace(start=lo - a, stop=hi - a))
        return clipped

    def advance(self) -> None:
        """The step is done: entries that got no gradient (all, if never received) fall behind."""
        received = self._mask if self._received else torch.zeros(len(self.group.entries), dtype=torch.uint8)
        self.steps.advance(received)
        self._received, self._mask = False, None

    # ---- the tier protocol ---------------------------------------------------------------
    def own_partitions(self) -> list[Partition]:
        """The partitions this group's optimizer owns (the parameter's is zero's, even as master)."""
        return [p for t in self.tiles for p in t.states if p is not self.group.param]

    def _read_by(self, j: int) -> list[Partition]:
        """The state partitions tile `j`'s read brings in (the whole parameter, where it is the
        master, with the first tile only)."""
        return [p for p in self.tiles[j].states if j == 0 or p is not self.group.param]

    def prefetch_bytes(self, j: int) -> int:
        """Bytes `prefetch(j)` would bring into the compute tier (0: the states live there)."""
        if self.plan.state_home == self.plan.compute_tier:
            return 0
        # a tile the tier keeps ([Note: residency]) is there already: it takes no room
        return sum(p.nbytes for p in self._read_by(j) if not p.is_resident(self.plan.compute_tier))

    def prefetch(self, j: int) -> list[TierFuture[None]]:
        """Start reading tile `j`'s states into the compute tier, unpinned ([Note: pipeline_read])."""
        return [self.tm.prefetch(p, self.plan.compute_tier) for p in self._read_by(j)]

    def issue_reads(self, j: int) -> list[TierFuture[torch.Tensor]]:
        """Fetch (pin) tile `j`'s master, exp_avg, exp_avg_sq into the compute tier, and with the
        first tile the whole gradient (and the parameter where it is the master); the futures of
        (master, exp_avg, exp_avg_sq, grad), the whole-group ones whole (`tile_views`)."""
        tier, tm, st = self.plan.compute_tier, self.tm, self.tiles[j].states
        if j == 0 and self.param_is_master:
            self._master_read = tm.fetch(self.group.param, tier)
        master = self._master_read if self.param_is_master else tm.fetch(st.master, tier)
        exp_avg, exp_avg_sq = tm.fetch(st.exp_avg, tier), tm.fetch(st.exp_avg_sq, tier)
        if j == 0:
            self._grad_read = tm.fetch(self.grad, tier)
        if master is None or self._grad_read is None:
            raise RuntimeError(f"group {self.name}: tile {j} read before tile 0")
        return [master, exp_avg, exp_avg_sq, self._grad_read]

    def tile_views(
        self,
        j: int,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tile `j`'s (master, grad, exp_avg, exp_avg_sq) from what `issue_reads(j)` fetched."""
        if len(self.tiles) == 1:
            return master, grad, exp_avg, exp_avg_sq
        a, b = self.tiles[j].start, self.tiles[j].stop
        return (master[a:b] if self.param_is_master else master), grad[a:b], exp_avg, exp_avg_sq

    def staging_buffer(self, j: int) -> torch.Tensor | None:
        """Tile `j`'s part of a pinned buffer for the new compute-dtype parameter in the stage
        tier, allocated whole with the first tile (None where the master is the parameter and is
        updated in place)."""
        if self.param_is_master:
            return None
        if j == 0:
            self._out = self.tm.allocate(self.group.param, self.plan.stage_tier).result()
        assert self._out is not None, f"group {self.name}: tile {j} stepped before tile 0"
        return self._out if len(self.tiles) == 1 else self._out[self.tiles[j].start : self.tiles[j].stop]

    def issue_writes(self, j: int) -> list[TierFuture[None]]:
        """After tile `j`'s update: its states dirty where they changed, unpinned, settled when
        staged away from home (evicted, a write-back when home is slower, unless the tier keeps
        them: [Note: kept copies]); after the last tile the same for the gradient (clean: freed)
        and the new parameter. The futures."""
        plan, tm = self.plan, self.tm
        futs: list[TierFuture[None]] = []
        param = self.group.param
        for part in self.tiles[j].states:
            if part is param:
                continue
            if not (plan.compute_tier == plan.state_home and part.valid_in() == {plan.state_home}):
                # (an in-place update of the only copy, at home in memory, needs no bookkeeping)
                tm.mark_dirty(part, plan.compute_tier)
            tm.release(part, plan.compute_tier)
            if plan.compute_tier != plan.state_home:
                futs.append(tm.settle(part, plan.compute_tier))
        if j < len(self.tiles) - 1:
            return futs
        self._grad_read = self._master_read = self._out = None
        # dirty where zero left it for this step, checked while still pinned (nothing moves it); a
        # gradient the tier keeps ([Note: residency]) stays there for the next backward instead
        consumed = (
            plan.compute_tier != self.grad.home
            and plan.compute_tier in self.grad.dirty_in()
            and not self.grad.is_kept(plan.compute_tier)
        )
        tm.release(self.grad, plan.compute_tier)
        if consumed:  # [Note: gradient consumed from memory]: never written home, nor read back
            self.grad_bytes_saved += 2 * self.grad.nbytes
            self.grad_consumed_steps += 1
            futs.append(tm.discard(self.grad, plan.compute_tier))
        elif plan.compute_tier != self.grad.home:
            futs.append(tm.settle(self.grad, plan.compute_tier))  # clean: free; kept: stays
        if self.kept is not None:  # its room is being freed: a flush may be waiting for it
            self.kept.stepped(self.grad, from_memory=consumed)
        # the new parameter: in the staging tier, or (alias) in the compute tier the master came to
        new_in = plan.compute_tier if self.param_is_master else plan.stage_tier
        if self.param_is_master and not (new_in == param.home and param.valid_in() == {new_in}):
            tm.mark_dirty(param, new_in)
        tm.release(param, new_in)
        if new_in != param.home:  # see [Note: max_in_cpu]
            futs.append(tm.settle(param, new_in))
        return futs

    # ---- checkpoints and tests -----------------------------------------------------------
    def master_shard(self) -> torch.Tensor:
        """A host copy of its fp32 master shard."""
        tier = self.plan.compute_tier
        parts = [self.group.param] if self.param_is_master else [t.states.master for t in self.tiles]
        out = []
        for part in parts:
            t = self.tm.fetch(part, tier).result()
            try:
                out.append(t.detach().to("cpu", copy=True))
            finally:
                self.tm.release(part, tier)
        return out[0] if len(out) == 1 else torch.cat(out)

    def checkpoint_partitions(self) -> dict[str, Partition | tuple[Partition, ...]]:
        """{"master", "exp_avg", "exp_avg_sq": Partition}, or where the group is stepped in
        several tiles, per kind the tiles' partitions in shard order; "master" is the parameter
        partition where that is the master."""
        if len(self.tiles) == 1:
            return dict(self.tiles[0].states._asdict())
        out: dict[str, Partition | tuple[Partition, ...]] = {
            kind: tuple(getattr(t.states, kind) for t in self.tiles) for kind in STATE_SUFFIXES
        }
        if self.param_is_master:
            out["master"] = self.group.param
        return out

    def param_step_counts(self, step_count: int) -> dict[str, int]:
        return self.steps.steps(step_count)

    def load_param_step_counts(self, counts: Mapping[str, int], step_count: int) -> None:
        self.steps.load_steps(counts, step_count)
