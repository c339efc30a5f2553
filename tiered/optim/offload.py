"""The offloaded Adam/AdamW: one fused update per sub-group, pipelined across the tiers.

[Note: sub-group pipeline]
Each trainable shard group has an `OptimGroup` (tiered/optim/group.py) owning its plan, its
state and gradient partitions, its step counts and this step's received mask, and moving them
(reads, write-backs) itself; `OffloadedAdam` is the pipeline that orders them. The optimizer
state (fp32 master, exp_avg, exp_avg_sq) of each shard group lives in partitions of its own on
the optimizer tier ("gpu" when offload_optimizer.device is none, else "cpu" or "nvme").

Tiles. The group planner never splits a parameter (tiered/zero/plan.py), so one parameter larger
than ``sub_group_size`` (a 128k-vocabulary embedding: 1.05B elements) makes a group that large.
Where a group's states are read from a slower home (offload_optimizer.device nvme, or any home
that is not the compute tier), its states are therefore partitions per *tile* of at most
``sub_group_size`` elements (`tile_bounds`; names ``<group>.<state>.t<index>``), and the step
takes one tile at a time: DeepSpeed's meaning of the key, an optimizer step over at most that
many elements. A group whose states live in the compute tier stages nothing and keeps one tile,
the whole shard. The tile is never below `MIN_TILE_NUMEL` (one 64 Ki block of the CPU kernel's
threads): ``sub_group_size`` 0 (one parameter per group, in DeepSpeed) would otherwise mean
one-element tiles. Adam is elementwise and the kernel gives an element the same bits on any path
([Note: bitwise-identical paths] in tiered_ext/csrc/cpu_adam/scalar_ops.h), so a tiled step is bitwise the untiled one; a
checkpoint holds one tensor per state either way, so it loads into any tiling.

A step walks the groups in execution order (so the next forward's first layers get their new
parameters first), tile by tile, and keeps up to ``buffer_count`` tiles in flight at once:

    read  tile k+1.. : fetch its states into the compute tier (async, TierManager); with a
                       group's first tile, its whole fp32 gradient too
    adam  tile k     : tiered_ext.adam_step (CPU) / gpu_adam_step (GPU side), the new
                       compute-dtype parameter written in the same pass into a buffer the
                       TierManager allocated for ``group.param`` (with the group's first tile)
    write tile k-1.. : states marked dirty, released and evicted from the compute tier (a write
                       back when their home is slower, e.g. nvme); after a group's last tile,
                       its gradient released and its new parameter evicted to its home

The gradient and the parameter are zero's partitions, one per group, and the tier manager moves
a partition whole, so they are staged whole: tiles bound the 8-12 B/element of state, not the
2-4 B of the parameter (nor the 4 B of a gradient kept on nvme, ``tiered.grad_tier``). "In
flight" counts tiles whose reads are issued but not consumed plus tiles whose write-backs have
not finished; a group's whole buffers live while one of its tiles is in flight, so at most
``buffer_count`` groups hold them. The pinned staging is then bounded by

    buffer_count x the largest tiles x (12 B, or 8 B where the parameter is the master)
    + buffer_count x the largest groups x (4 B grad if not at home + param bytes if staged)

per tier (`tiered.optim.placement.pipeline_bytes`): what `stage_bytes_needed` reports and the
engine checks against the budgets before training. For the 36B, 128k-vocabulary headline (two
1.05B-element groups, embedding and lm_head, then 235M-element ones) in bf16 with parameters and
states on nvme, gradients in cpu, ``buffer_count`` 4 and ``sub_group_size`` 1e8, that is 9.94 GB
(4.8 GB of state tiles, 5.1 GB of whole parameters) instead of 36.0 GB with the groups whole.

[Note: pipeline_read]
At the start of the last backward of a step the engine calls `prefetch_states`: the first
``buffer_count`` tiles' states start moving into the compute tier, so the step does not begin
with a read. With ``offload_optimizer.pipeline_read`` every tile's states are prefetched, in step
order, while backward runs (the read link is otherwise idle then): the step then mostly finds its
states resident, at the cost of holding them in the cpu tier transiently. Prefetches are unpinned
and issued only while they fit in half of the cpu tier's free budget, so they never crowd out
the pipeline's own buffers (the manager may drop them for free under pressure). With
``offload_optimizer.pipeline_write`` the write-backs in flight no longer count against the
``buffer_count`` window: they drain while the next groups compute and during the next forward,
bounded only by the cpu budget (the manager's backpressure), the other half of the same trade.

[Note: step overlapped with backward]
With ``tiered.overlap_step_with_backward`` (off by default) and nothing that needs the whole
gradient before any update (no gradient_clipping, no fp16 overflow check), the engine calls
`begin_overlapped_step` before the accumulation boundary's backward, and each group's update is
queued (`group_ready`) the moment its gradients are flushed: the pipeline above then runs on a
stepper thread in gradient-completion order (the reverse of forward), reading a group's states
while backward still computes earlier layers. `finish_overlapped_step` (in ``engine.step()``)
queues the groups whose gradients were only partly complete in backward, once "received" is
decided across ranks, and skips those that got none (see [Note: parameters without a gradient
are not stepped] in tiered/optim/runs.py); then it waits.
The arithmetic is the same per group, so results are bitwise those of the plain step. A group's
parameters must not be used again by that backward once its gradients are complete; the
scheduler raises if they are (see ZeroParameters.seal_for_step). The price of starting early: a
backward that fails midway (an exception in the model, a CapacityError) leaves the groups already
handed over stepped and the rest not; the engine stops the step there (nothing hangs), but such a
model is half-stepped: restart from a checkpoint rather than train on.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tiered.config.schema import TieredConfig
from tiered.errors import CheckpointCorruptError, UnsupportedConfigError
from tiered.optim.arrivals import Arrivals
from tiered.optim.group import OptimGroup
from tiered.optim.kept_grads import KeptGrads
from tiered.optim.kernels import adam_update
from tiered.optim.placement import (
    GroupPlan,
    StatePartitions,
    decode_scratch_numel,
    optimizer_tile_numel,
    pipeline_bytes,
    plan_optimizer_placement,
    tier_is_host,
)
from tiered.optim.runs import ParamHyper, entry_hypers
from tiered.optim.state_format import rounding_noise, state_format
from tiered.optim.writebacks import WriteBacks
from tiered.shards import ShardGroup

if TYPE_CHECKING:
    from tiered.tiers import Partition, TierFuture, TierManager

log = logging.getLogger(__name__)

__all__ = [
    "GradsReceived",
    "GroupPlan",
    "OffloadedAdam",
    "OptimGroup",
    "ParamHyper",
    "StatePartitions",
    "pipeline_bytes",
    "plan_optimizer_placement",
]


class GradsReceived(Protocol):
    """Which entries of a group received a gradient in this accumulation window (uint8 per entry):
    the coordinator's record. See [Note: parameters without a gradient are not stepped]."""

    def received_local(self, group: ShardGroup) -> torch.Tensor: ...

    def received_across_ranks(self, groups: Sequence[ShardGroup]) -> list[torch.Tensor]: ...


class OffloadedAdam:
    """Adam/AdamW over `OptimGroup`s whose state lives in TierManager partitions: the pipeline
    that orders their reads, updates and write-backs.

    See [Note: sub-group pipeline], [Note: write-back after the step], [Note: max_in_cpu],
    [Note: pipeline_read] and [Note: twin-flow ratio].
    """

    def __init__(
        self,
        tm: TierManager,
        groups: Sequence[ShardGroup],
        cfg: TieredConfig,
        initial_fp32: Callable[[ShardGroup], torch.Tensor],
        *,
        optimizer_tier: str,
        compute_dtype: torch.dtype,
        plans: Sequence[GroupPlan] | None = None,
        on_params_written: Callable[[ShardGroup], None] | None = None,
        param_hyper: Mapping[str, ParamHyper] | None = None,
        grads_received: GradsReceived | None = None,
    ) -> None:
        """`groups` are the trainable groups; `plans` their `plan_optimizer_placement` (the engine
        passes the ones its capacity check used; computed here only when not given).
        `param_hyper`: per parameter name (the group entry's), its own weight decay and lr scale
        (parameter groups); the others use the config's. `grads_received`: which parameters got a
        gradient this step (None: all of them, every step)."""
        self.tm = tm
        self.cfg = cfg
        self.opt = cfg.optimizer
        self.compute_dtype = compute_dtype
        self.optimizer_tier = optimizer_tier
        self.buffer_count = max(1, int(cfg.zero.offload_optimizer.buffer_count))
        self.on_params_written = on_params_written
        self.step_count = 0
        """Optimizer steps taken (1-based in the kernel: torch's bias correction)."""
        self._writes = WriteBacks(float(getattr(cfg.tiered, "timeout_s", 600.0)))
        """The write-backs in flight: see [Note: write-back after the step]."""
        # The overlapped step's pipeline runs here while backward runs in the caller's thread.
        self._stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered-opt-step")
        self._overlap: tuple[Arrivals, Future[dict[str, float]]] | None = None
        self._kept: KeptGrads | None = None
        """The gradients flushes keep in "cpu" for the overlapped step (`keep_grads_in_memory`)."""
        self._timeout_s = float(getattr(cfg.tiered, "timeout_s", 600.0))
        self.tile_numel = optimizer_tile_numel(cfg)
        """Elements per tile of a group whose states are staged ([Note: sub-group pipeline])."""
        shards = list(groups)
        if plans is None:
            plans = plan_optimizer_placement(shards, cfg, optimizer_tier, gpu_is_host=tier_is_host(tm, "gpu"))
        if len(plans) != len(shards):
            raise ValueError(
                f"{len(plans)} optimizer plans for {len(shards)} groups: one per trainable group"
            )
        self.grads_received = grads_received
        default = ParamHyper(float(self.opt.weight_decay), 1.0)
        hypers = entry_hypers(shards, default, param_hyper)
        self.fmt = state_format(cfg.tiered.optimizer_state_format, optimizer=cfg.optimizer.type)
        """How the moments are stored ([Note: compressed optimizer state]); fp32 unless opted in."""
        if not self.fmt.lossless and any(p.side != "cpu" for p in plans):
            raise UnsupportedConfigError(
                f"tiered.optimizer_state_format = {self.fmt.name!r} compresses offloaded optimizer "
                "state, stepped by the CPU kernel; here some groups keep their state in 'gpu' "
                "(zero_optimization.offload_optimizer.device none, or offload_optimizer.ratio < 1): "
                "offload the optimizer to 'cpu' or 'nvme' with ratio 1, or use 'fp32'"
            )
        for g in shards:
            if g.grad is None:
                raise ValueError(
                    f"OffloadedAdam steps trainable groups only; group {g.name} is frozen (no gradient)"
                )
        self.groups: list[OptimGroup] = []
        """Per trainable group, in execution order: its plan, partitions, step counts, mask."""
        for g, plan, h in zip(shards, plans, hypers, strict=True):
            self.groups.append(
                OptimGroup(
                    tm,
                    g,
                    plan,
                    h,
                    initial_fp32(g),
                    compute_dtype=compute_dtype,
                    tile_numel=self.tile_numel,
                    fmt=self.fmt,
                )
            )
        self._index = {og.name: i for i, og in enumerate(self.groups)}
        n = decode_scratch_numel(shards, plans, self.tile_numel, self.fmt)
        self._decoded = (torch.empty(n), torch.empty(n)) if n else None
        """The fp32 moments of the tile being stepped, decoded from a compressed format: one pair
        for every tile (`decode_scratch_numel`), so the step allocates nothing per tile."""
        self._totals = {
            "read_wait_s": 0.0,
            "compute_s": 0.0,
            "write_wait_s": 0.0,
            "steps": 0,
            "overlapped_steps": 0,
        }
        self.last_step: dict[str, float] = {}

    def keep_grads_in_memory(self) -> KeptGrads:
        """The overlapped step will consume each gradient a flush keeps in "cpu" ([Note: gradient
        consumed from memory] in tiered/optim/group.py); the returned keeper admits those flushes
        and orders the tier's evictions: [Note: backward waits instead of parking]."""
        if self._kept is None:
            tier = "cpu"  # the stage tier of a gradient homed in storage (tiered/zero/grad_home.py)
            staging = self.stage_bytes_needed().get(tier, 0)
            # the copies the tier keeps across steps ([Note: residency]): room the kept gradients
            # must not take, or each step writes them home and reads them back ([Note: backward
            # waits instead of parking])
            kept = self.tm.kept_bytes(tier)
            self._kept = KeptGrads(self.tm, tier, staging + kept, self._timeout_s)
            for og in self.groups:
                og.kept = self._kept
        return self._kept

    def stage_bytes_needed(self) -> dict[str, int]:
        return pipeline_bytes(
            [og.group for og in self.groups],
            [og.plan for og in self.groups],
            self.buffer_count,
            self.compute_dtype,
            self.tile_numel,
            self.fmt,
        )

    def group(self, group: ShardGroup) -> OptimGroup:
        """The optimizer's side of trainable `group`."""
        return self.groups[self._index[group.name]]

    # ---- the step --------------------------------------------------------------------------
    def prefetch_states(self) -> list[TierFuture[None]]:
        """Start reading optimizer states into their compute tier during backward, unpinned, so
        the step's reads find them resident; returns the prefetch futures. See [Note: pipeline_read]."""
        tm = self.tm
        futs: list[TierFuture[None]] = []
        jobs = [(og, j) for og in self.groups for j in range(len(og.tiles))]
        count = len(jobs) if self.cfg.zero.offload_optimizer.pipeline_read else self.buffer_count
        room: dict[str, float] = {}
        for og, j in jobs[:count]:
            need = og.prefetch_bytes(j)
            if not need:
                continue
            tier = og.plan.compute_tier
            if tier not in room:
                budget = tm.tier(tier).budget_bytes
                room[tier] = float("inf") if budget is None else (budget - tm.resident_bytes(tier)) / 2
            if need > room[tier]:
                break
            room[tier] -= need
            futs.extend(og.prefetch(j))
        return futs

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One Adam step over every group. The last write-backs (at most buffer_count groups)
        stay in flight and overlap the next forward; see [Note: write-back after the step]."""
        if self._overlap is not None:
            raise RuntimeError(
                "OffloadedAdam.step() while an overlapped step is running; call finish_overlapped_step()"
            )
        self.wait_writes()
        self.step_count += 1
        masks = self._received_across_ranks()
        arrivals = Arrivals(self._timeout_s)
        for i, og in enumerate(self.groups):
            if og.receive(masks[i]):
                arrivals.put(i)
        arrivals.close()
        self._record(self._pipeline(arrivals, lr, grad_scale))
        self._advance()

    def _received_across_ranks(self) -> list[torch.Tensor | None]:
        if self.grads_received is None:
            return [None] * len(self.groups)
        return list(self.grads_received.received_across_ranks([og.group for og in self.groups]))

    def _advance(self) -> None:
        """The step is done: parameters that got no gradient fall a step behind."""
        for og in self.groups:
            og.advance()

    # ---- overlapped with backward: see [Note: step overlapped with backward] ------------------
    def begin_overlapped_step(self, lr: float, grad_scale: float = 1.0) -> None:
        """Start a step whose groups run as their gradients complete (`group_ready`), on a
        stepper thread, while backward goes on; `finish_overlapped_step` ends it."""
        if self._overlap is not None:
            raise RuntimeError("an overlapped step is already running; call finish_overlapped_step() first")
        self.wait_writes()
        self.step_count += 1
        arrivals = Arrivals(self._timeout_s)
        if self._kept is not None:
            self._kept.begin_step()
        fut = self._stepper.submit(self._overlapped_pipeline, arrivals, lr, grad_scale)
        self._overlap = (arrivals, fut)

    def _overlapped_pipeline(self, arrivals: Arrivals, lr: float, grad_scale: float) -> dict[str, float]:
        try:
            return self._pipeline(arrivals, lr, grad_scale)
        finally:  # a flush waiting for room must not wait on a stepper that stopped
            if self._kept is not None:
                self._kept.end_step()

    def group_ready(self, group: ShardGroup) -> None:
        """`group`'s gradients for this step are complete: queue its update (non-blocking). A no-op
        when no overlapped step runs (a micro-batch before the accumulation boundary)."""
        if self._overlap is None:
            return
        i = self._index[group.name]
        mask = None if self.grads_received is None else self.grads_received.received_local(group)
        # complete here means complete on every rank; otherwise wait for the ranks' verdict
        if mask is None or bool(mask.all()):
            self.groups[i].receive(mask)
            if self._kept is not None:  # before the stepper can take it
                self._kept.queued(self.groups[i].grad)
            self._overlap[0].put(i)

    @property
    def overlapped_step_running(self) -> bool:
        return self._overlap is not None

    def finish_overlapped_step(self, *, abort: bool = False) -> None:
        """Queue the groups not yet queued that received a gradient on some rank (skipping those
        none reached) and wait until every queued group was updated and its write-back issued.
        With `abort` (backward failed), stop after the groups already queued."""
        if self._overlap is None:
            return
        arrivals, fut = self._overlap
        self._overlap = None
        in_backward = arrivals.available()
        try:
            if not abort:
                masks = self._received_across_ranks()  # every rank calls this: a collective
                for i, og in enumerate(self.groups):
                    if not og.received and og.receive(masks[i]):
                        arrivals.put(i)
        finally:
            arrivals.close()
        self._record(
            {
                **fut.result(timeout=self._timeout_s * max(1, len(self.groups))),
                "groups_ready_in_backward": in_backward,
            }
        )
        self._advance()
        self._totals["overlapped_steps"] += 1

    def _record(self, timings: dict[str, float]) -> None:
        self.last_step = timings
        for k, v in timings.items():
            self._totals[k] = self._totals.get(k, 0) + v
        self._totals["steps"] += 1

    def _pipeline(self, arrivals: Arrivals, lr: float, grad_scale: float) -> dict[str, float]:
        """Update the groups tile by tile in the order `arrivals` yields them, reading ahead up to
        buffer_count tiles. See [Note: sub-group pipeline]."""
        jobs: list[tuple[int, int]] = []  # (group, tile) in step order
        expanded = 0  # arrivals turned into jobs

        def expand(i: int) -> None:
            nonlocal expanded
            jobs.extend((i, j) for j in range(len(self.groups[i].tiles)))
            expanded += 1

        reads: dict[int, list[TierFuture[torch.Tensor]]] = {}
        t_read = t_comp = t_write = 0.0
        k = next_read = 0
        # pipeline_write: write-backs are not counted against the window (see [Note: pipeline_read])
        bound_writes = not self.cfg.zero.offload_optimizer.pipeline_write
        while True:
            if k == len(jobs):
                if (i := arrivals.get(expanded)) is None:
                    break
                expand(i)
            while expanded < arrivals.available():
                expand(arrivals.at(expanded))
            i, j = jobs[k]
            if next_read == k:
                while bound_writes and len(self._writes) + 1 > self.buffer_count:
                    t_write += self._writes.retire_in_step()
                reads[k] = self.groups[i].issue_reads(j)
                next_read += 1
            while (
                next_read < len(jobs)
                and (next_read - k) + bound_writes * len(self._writes) < self.buffer_count
            ):
                reads[next_read] = self.groups[jobs[next_read][0]].issue_reads(jobs[next_read][1])
                next_read += 1
            t0 = time.perf_counter()
            master, exp_avg, exp_avg_sq, grad = (f.result() for f in reads.pop(k))
            t1 = time.perf_counter()
            self._update(i, j, master, exp_avg, exp_avg_sq, grad, lr, grad_scale)
            t2 = time.perf_counter()
            tile = {"tile": j} if len(self.groups[i].tiles) > 1 else {}
            self.tm.record_span(f"adam {self.groups[i].name}", "adam", t1, t2, step=self.step_count, **tile)
            self._writes.submit(functools.partial(self._finish_tile, i, j))
            while self._writes.oldest_done():
                t_write += self._writes.retire_in_step()
            t_read += t1 - t0
            t_comp += t2 - t1
            k += 1
        t3 = time.perf_counter()
        self._writes.all_issued()
        t_write += time.perf_counter() - t3
        return {"read_wait_s": t_read, "compute_s": t_comp, "write_wait_s": t_write}

    def _update(
        self,
        i: int,
        j: int,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor,
        lr: float,
        grad_scale: float,
    ) -> None:
        """Step tile `j` of group `i` (tensors as its reads returned them)."""
        og = self.groups[i]
        lowp = self.compute_dtype != torch.float32
        master, grad, exp_avg, exp_avg_sq = og.tile_views(j, master, exp_avg, exp_avg_sq, grad)
        out = og.staging_buffer(j)  # None: [Note: fp32 master is the parameter], updated in place
        if lowp and out is not None and out.device != master.device:
            raise RuntimeError(f"group {og.name}: staging buffer on {out.device}, master on {master.device}")
        stored = None
        if not self.fmt.lossless:  # [Note: compressed optimizer state]: decode, exact Adam, encode
            stored = (exp_avg.view(torch.uint8), exp_avg_sq.view(torch.uint8))
            assert self._decoded is not None and master.numel() <= self._decoded[0].numel()
            exp_avg, exp_avg_sq = (t[: master.numel()] for t in self._decoded)
            self.fmt.exp_avg.decode(stored[0], exp_avg)
            self.fmt.exp_avg_sq.decode(stored[1], exp_avg_sq)
        adam_update(
            self.opt,
            og.runs(j),
            og.plan.side,
            (master, grad, exp_avg, exp_avg_sq),
            out if lowp else None,
            step_count=self.step_count,
            lr=lr,
            grad_scale=grad_scale,
        )
        if stored is not None:
            # [Note: counter-based rounding noise]: keyed by the group and the tile's global offset
            step, gi, first = self.step_count, og.group.index, og.group.shard_offset + og.tiles[j].start
            self.fmt.exp_avg.encode(exp_avg, stored[0], rounding_noise(step, gi, "exp_avg", first))
            self.fmt.exp_avg_sq.encode(exp_avg_sq, stored[1], rounding_noise(step, gi, "exp_avg_sq", first))
        if out is not None and not lowp:
            out.copy_(master)

    def _finish_tile(self, i: int, j: int) -> list[TierFuture[None]]:
        og = self.groups[i]
        futs = og.issue_writes(j)
        if j == len(og.tiles) - 1 and self.on_params_written is not None:
            self.on_params_written(og.group)
        return futs

    def wait_writes(self) -> float:
        """Block until every write-back issued by a step has finished; returns seconds waited.
        A failed one raises, once, after all the others ended: see
        [Note: a failed write-back is retried by flush] in tiered/optim/writebacks.py."""
        return self._writes.wait()

    def close(self) -> None:
        """Wait for the write-backs in flight and stop the worker threads. Idempotent."""
        try:
            self.finish_overlapped_step(abort=True)
            self.wait_writes()
        finally:
            self._stepper.shutdown(wait=True)
            self._writes.shutdown()

    # ---- introspection: each group answers for itself ------------------------------------
    def state_partitions(self, group: ShardGroup) -> StatePartitions:
        """`group`'s master / exp_avg / exp_avg_sq partitions (checkpoints); the step count they
        belong to is `step_count`."""
        return self.group(group).states

    def master_shard(self, group_index: int) -> torch.Tensor:
        """A host copy of one group's fp32 master shard (tests, checkpoints)."""
        return self.groups[group_index].master_shard()

    def own_partitions(self) -> list[Partition]:
        """Every partition the optimizer created (not the parameters', even where one is a master)."""
        return [p for og in self.groups for p in og.own_partitions()]

    def checkpoint_partitions(self) -> dict[str, dict[str, Any]]:
        """For checkpoints (tiered/checkpoint): group name -> {"master", "exp_avg", "exp_avg_sq":
        Partition}; "master" is the group's parameter partition where that partition is the
        master (see [Note: fp32 master is the parameter])."""
        return {og.name: og.checkpoint_partitions() for og in self.groups}

    def param_step_counts(self) -> dict[str, int]:
        """Per parameter name: its own step count (checkpoints; equal to `step_count` for every
        parameter that got a gradient in every step). See [Note: parameters without a gradient
        are not stepped]."""
        out: dict[str, int] = {}
        for og in self.groups:
            out.update(og.param_step_counts(self.step_count))
        return out

    def load_step_counts(self, optimizer_step: object, param_steps: Mapping[str, int] | None) -> None:
        """Restore the step counts a checkpoint recorded: the optimizer's (bias correction, the
        lr schedule's position, the rounding seeds) and each parameter's. The optimizer owns its
        counters, so it also checks what it is given: a count that is not a non-negative int is
        refused naming the manifest key instead of training with a wrong bias correction.
        `param_steps` None (an older checkpoint): every parameter counts every step."""
        if isinstance(optimizer_step, bool) or not isinstance(optimizer_step, int) or optimizer_step < 0:
            raise CheckpointCorruptError(
                f"the checkpoint's training.optimizer_step is {optimizer_step!r}, not a non-negative "
                "integer: its manifest was edited or written by something else; load another "
                "checkpoint or pass load_optimizer_states=False to start the optimizer afresh"
            )
        self.step_count = optimizer_step
        for og in self.groups:
            og.load_param_step_counts(param_steps or {}, self.step_count)

    def stats(self) -> dict[str, Any]:
        return {
            "groups_cpu": sum(og.plan.side == "cpu" for og in self.groups),
            "groups_gpu": sum(og.plan.side == "gpu" for og in self.groups),
            "buffer_count": self.buffer_count,
            "tile_numel": self.tile_numel,
            "tiles": sum(len(og.tiles) for og in self.groups),
            # [Note: gradient consumed from memory]
            "grad_consumed_from_memory": {
                "group_steps": sum(og.grad_consumed_steps for og in self.groups),
                "bytes_saved": sum(og.grad_bytes_saved for og in self.groups),
            },
            # [Note: backward waits instead of parking]: kept gradients written home anyway
            "grad_parked": {} if self._kept is None else self._kept.stats(),
            "step_count": self.step_count,
            "last_step": dict(self.last_step),
            "total": dict(self._totals),
        }
