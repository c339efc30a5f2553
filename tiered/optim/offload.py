"""The offloaded Adam/AdamW: one fused update per sub-group, pipelined across the tiers.

[Note: sub-group pipeline]
The optimizer state (fp32 master, exp_avg, exp_avg_sq) of each shard group lives in its own
partitions on the optimizer tier ("gpu" when offload_optimizer.device is none, else "cpu" or
"nvme"). A step walks the groups in execution order (so the next forward's first layers get their
new parameters first) and keeps up to ``buffer_count`` groups in flight at once:

    read  group i+1.. : fetch states + fp32 grad into the compute tier (async, TierManager)
    adam  group i     : tiered_ext.adam_step (CPU) / gpu_adam_step (GPU side), the new
                        compute-dtype parameter written in the same pass into a buffer the
                        TierManager allocated for ``group.param``
    write group i-1.. : states marked dirty, released and evicted from the compute tier (a write
                        back when their home is slower, e.g. nvme), params evicted to their home

[Note: write-back after the step]
The step returns with the last groups' write-backs still in flight. That is safe because the
TierManager serialises moves of one partition: a fetch of a parameter or state whose copy is
being evicted waits for the write-back and then reads the new bytes from home. The next step,
``wait_writes``, ``Engine.flush`` and ``Engine.close`` wait for them (and re-raise their errors).

[Note: a failed write-back is retried by flush]
A write-back that fails (ENOSPC on a full disk, an I/O error after its retries) loses nothing: the
tier manager marks the home copy valid only once a write completed, so the updated copy stays,
dirty, in the compute tier. The error must not cut a step in half either, so one met inside a
step (the ``buffer_count`` back-pressure) is kept and the step's other groups still update;
``wait_writes`` waits for every write in flight and raises the first error (the number of others
is logged). `Engine.step` calls it before it counts anything, so the step that raises it has done
nothing yet: once space is freed, ``engine.flush()`` writes the dirty copies home and the same
``engine.step()`` goes on, ending bit for bit where an undisturbed run does.

"In flight" counts groups whose reads are issued but not consumed plus groups whose write-backs
have not finished, so the pinned staging memory is bounded by
``buffer_count x (12 + param bytes) x largest shard``: what `stage_bytes_needed` reports and the
engine checks against the cpu budget before training.

[Note: max_in_cpu]
New parameters staged in "cpu" whose home is slower (nvme) stay there, dirty, for up to
``offload_param.max_in_cpu`` elements (DeepSpeed's knob of the same meaning, "parameter elements
to maintain in CPU memory when offloading to NVMe", default 1e9): the next forward gathers them
with a memory copy instead of an NVMe read, and no step writes them to NVMe. The copy is an
ordinary dirty copy of the tier manager, so when the cpu budget needs the room it is written
home and dropped (write-back); ``Engine.flush`` writes it home too. Beyond the limit the staging
copy is evicted right after the step (written back and freed). (Until this version the copy was
written through to NVMe every step: on benchmarks/step.py that was 143 of 428 MB written per step.)

[Note: pipeline_read]
At the start of the last backward of a step the engine calls `prefetch_states`: the first
``buffer_count`` groups' states start moving into the compute tier, so the step does not begin
with a read. With ``offload_optimizer.pipeline_read`` every group's states are prefetched, in step
order, while backward runs (the read link is otherwise idle then): the step then mostly finds its
states resident, at the cost of holding them in the cpu tier transiently. Prefetches are unpinned
and issued only while they fit in half of the cpu tier's free budget, so they never crowd out
the pipeline's own buffers (the manager may drop them for free under pressure). With
``offload_optimizer.pipeline_write`` the write-backs in flight no longer count against the
``buffer_count`` window: they drain while the next groups compute and during the next forward,
bounded only by the cpu budget (the manager's backpressure), the other half of the same trade.

[Note: fp32 master is the parameter]
In an fp32 run the master *is* the parameter, bit for bit. When the parameter's home is also the
optimizer tier (both "cpu", or both "nvme") and the CPU kernel steps the group, the group's
parameter partition serves as its master: no second copy is kept, read, written or copied into
(on the step benchmark that removes 2 of the 7 shard-sized transfers per step: the master's read
and write). Elsewhere (bf16/fp16, or a parameter kept on the GPU while the state is offloaded)
the master is a partition of its own on the optimizer tier.

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

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tiered.config.schema import TieredConfig
from tiered.optim.placement import (
    GroupPlan,
    StatePartitions,
    pipeline_bytes,
    plan_optimizer_placement,
    state_partition_specs,
    tier_is_host,
)
from tiered.optim.runs import GroupSteps, ParamHyper, Run, entry_hypers
from tiered.shards import ShardGroup

if TYPE_CHECKING:
    from tiered.tiers import Partition, TierFuture, TierManager

log = logging.getLogger(__name__)

__all__ = [
    "GradsReceived",
    "GroupPlan",
    "OffloadedAdam",
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


class _Arrivals:
    """Group indices in the order they became ready to step; each index once. `get(k)` blocks
    until the k-th arrived (or returns None once closed with fewer)."""

    def __init__(self, timeout_s: float) -> None:
        self._items: list[int] = []
        self._seen: set[int] = set()
        self._closed = False
        self._cv = threading.Condition()
        self._timeout_s = timeout_s

    def put(self, i: int) -> None:
        with self._cv:
            if i in self._seen or self._closed:
                return
            self._seen.add(i)
            self._items.append(i)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def available(self) -> int:
        with self._cv:
            return len(self._items)

    def at(self, k: int) -> int:
        with self._cv:
            return self._items[k]

    def get(self, k: int) -> int | None:
        with self._cv:
            if not self._cv.wait_for(lambda: len(self._items) > k or self._closed, timeout=self._timeout_s):
                raise TimeoutError(
                    f"overlapped optimizer step: no group became ready within {self._timeout_s:.0f} s "
                    "(tiered.timeout_s); did backward stop without engine.step()?"
                )
            return self._items[k] if len(self._items) > k else None


def _kernels() -> Any:
    import tiered_ext

    return tiered_ext


class OffloadedAdam:
    """Adam/AdamW over `ShardGroup`s whose state lives in TierManager partitions.

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
        self.groups = list(groups)
        self.cfg = cfg
        self.opt = cfg.optimizer
        self.compute_dtype = compute_dtype
        self.optimizer_tier = optimizer_tier
        self.buffer_count = max(1, int(cfg.zero.offload_optimizer.buffer_count))
        self.on_params_written = on_params_written
        self.step_count = 0
        """Optimizer steps taken (1-based in the kernel: torch's bias correction)."""
        self._pending: deque[tuple[int, Future[list[TierFuture]]]] = deque()
        # One FIFO thread finishes groups (mark dirty, unpin, evict): each of those is a round
        # trip to the manager's loop, which would otherwise stall the kernel of the next group.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered-opt-write")
        # The overlapped step's pipeline runs here while backward runs in the caller's thread.
        self._stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered-opt-step")
        self._overlap: tuple[_Arrivals, Future[dict[str, float]]] | None = None
        self._index = {g.name: i for i, g in enumerate(groups)}
        self._timeout_s = float(getattr(cfg.tiered, "timeout_s", 600.0))
        if plans is None:
            plans = plan_optimizer_placement(
                self.groups, cfg, optimizer_tier, gpu_is_host=tier_is_host(tm, "gpu")
            )
        if len(plans) != len(self.groups):
            raise ValueError(
                f"{len(plans)} optimizer plans for {len(self.groups)} groups: one per trainable group"
            )
        self.plans: list[GroupPlan] = list(plans)
        self.grads_received = grads_received
        default = ParamHyper(float(self.opt.weight_decay), 1.0)
        self.param_steps: list[GroupSteps] = [
            GroupSteps(g, h)
            for g, h in zip(self.groups, entry_hypers(self.groups, default, param_hyper), strict=True)
        ]
        """Per group, by position: its entries' own step counts and the runs of its shard."""
        self._masks: dict[int, torch.Tensor | None] = {}
        """Per group of the step in progress: which entries received a gradient (None: all)."""
        self._grads: list[Partition] = []
        """Per group, by position: its fp32 gradient partition (every stepped group has one)."""
        for g in self.groups:
            if g.grad is None:
                raise ValueError(
                    f"OffloadedAdam steps trainable groups only; group {g.name} is frozen (no gradient)"
                )
            self._grads.append(g.grad)
        """Per group, by position: where its step runs and its state lives."""
        self._keep_in_cpu = self._params_kept_in_cpu()
        self.states: list[StatePartitions] = []
        """Per group, by position: its master / exp_avg / exp_avg_sq partitions (checkpoints)."""
        self._param_is_master: set[int] = set()  # [Note: fp32 master is the parameter]
        self._write_errors: list[Exception] = []
        """Write-backs that failed inside a step, raised by the next `wait_writes`."""
        for i, (g, plan) in enumerate(zip(self.groups, self.plans, strict=True)):
            master = initial_fp32(g).to(torch.float32).reshape(-1)
            if master.numel() != g.shard_numel:
                raise ValueError(
                    f"initial fp32 shard of group {g.name} has {master.numel()} elements, "
                    f"expected shard_numel={g.shard_numel}"
                )
            # the same specs the engine's capacity check counted before any was written
            specs = state_partition_specs(g, plan, compute_dtype)
            alias = len(specs) == 2
            if alias:
                self._param_is_master.add(i)
            made = [
                tm.create(name, numel, dtype, home, init=master if name.endswith(".master") else None)
                for name, numel, dtype, home in specs
            ]
            parts = StatePartitions(g.param, *made) if alias else StatePartitions(*made)
            del master
            self.states.append(parts)
        self._totals = {
            "read_wait_s": 0.0,
            "compute_s": 0.0,
            "write_wait_s": 0.0,
            "steps": 0,
            "overlapped_steps": 0,
        }
        self.last_step: dict[str, float] = {}

    def _params_kept_in_cpu(self) -> set[int]:
        keep, total = set(), 0
        limit = int(self.cfg.zero.offload_param.max_in_cpu_numel)
        for i, (g, p) in enumerate(zip(self.groups, self.plans, strict=True)):
            if (
                p.stage_tier == "cpu"
                and g.param.home not in ("cpu", "gpu")
                and total + g.shard_numel <= limit
            ):
                keep.add(i)
                total += g.shard_numel
        return keep

    def stage_bytes_needed(self) -> dict[str, int]:
        return pipeline_bytes(self.groups, self.plans, self.buffer_count, self.compute_dtype)

    # ---- the step --------------------------------------------------------------------------
    def prefetch_states(self) -> list[TierFuture]:
        """Start reading optimizer states into their compute tier during backward, unpinned, so
        the step's reads find them resident; returns the prefetch futures. See [Note: pipeline_read]."""
        tm = self.tm
        futs: list[TierFuture] = []
        count = len(self.groups) if self.cfg.zero.offload_optimizer.pipeline_read else self.buffer_count
        room: dict[str, float] = {}
        for i in range(min(count, len(self.groups))):
            plan = self.plans[i]
            if plan.state_home == plan.compute_tier:
                continue
            tier = plan.compute_tier
            if tier not in room:
                budget = tm.tier(tier).budget_bytes
                room[tier] = float("inf") if budget is None else (budget - tm.resident_bytes(tier)) / 2
            need = sum(p.nbytes for p in self.states[i])
            if need > room[tier]:
                break
            room[tier] -= need
            futs.extend(tm.prefetch(part, tier) for part in self.states[i])
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
        arrivals = _Arrivals(self._timeout_s)
        for i in range(len(self.groups)):
            if self._receives(i, masks[i]):
                arrivals.put(i)
        arrivals.close()
        self._record(self._pipeline(arrivals, lr, grad_scale))
        self._advance()

    def _received_across_ranks(self) -> list[torch.Tensor | None]:
        if self.grads_received is None:
            return [None] * len(self.groups)
        return list(self.grads_received.received_across_ranks(self.groups))

    def _receives(self, i: int, mask: torch.Tensor | None) -> bool:
        """Record group i's mask for this step; False if none of its parameters got a gradient."""
        self._masks[i] = mask
        return mask is None or bool(mask.any())

    def _advance(self) -> None:
        """The step is done: parameters that got no gradient fall a step behind."""
        for i, steps in enumerate(self.param_steps):
            steps.advance(self._masks.get(i, torch.zeros(len(self.groups[i].entries), dtype=torch.uint8)))
        self._masks = {}

    # ---- overlapped with backward: see [Note: step overlapped with backward] ------------------
    def begin_overlapped_step(self, lr: float, grad_scale: float = 1.0) -> None:
        """Start a step whose groups run as their gradients complete (`group_ready`), on a
        stepper thread, while backward goes on; `finish_overlapped_step` ends it."""
        if self._overlap is not None:
            raise RuntimeError("an overlapped step is already running; call finish_overlapped_step() first")
        self.wait_writes()
        self.step_count += 1
        arrivals = _Arrivals(self._timeout_s)
        fut = self._stepper.submit(self._pipeline, arrivals, lr, grad_scale)
        self._overlap = (arrivals, fut)

    def group_ready(self, group: ShardGroup) -> None:
        """`group`'s gradients for this step are complete: queue its update (non-blocking). A no-op
        when no overlapped step runs (a micro-batch before the accumulation boundary)."""
        if self._overlap is None:
            return
        i = self._index[group.name]
        mask = None if self.grads_received is None else self.grads_received.received_local(group)
        # complete here means complete on every rank; otherwise wait for the ranks' verdict
        if mask is None or bool(mask.all()):
            self._receives(i, mask)
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
                for i in range(len(self.groups)):
                    if i not in self._masks and self._receives(i, masks[i]):
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

    def _pipeline(self, arrivals: _Arrivals, lr: float, grad_scale: float) -> dict[str, float]:
        """Update the groups in the order `arrivals` yields them, reading ahead up to
        buffer_count groups. See [Note: sub-group pipeline]."""
        reads: dict[int, list[TierFuture]] = {}
        t_read = t_comp = t_write = 0.0
        k = next_read = 0
        # pipeline_write: write-backs are not counted against the window (see [Note: pipeline_read])
        bound_writes = not self.cfg.zero.offload_optimizer.pipeline_write
        while (i := arrivals.get(k)) is not None:
            if next_read == k:
                while bound_writes and self._pending and len(self._pending) + 1 > self.buffer_count:
                    t_write += self._retire_in_step()
                reads[k] = self._issue_reads(i)
                next_read += 1
            while (
                next_read < arrivals.available()
                and (next_read - k) + bound_writes * len(self._pending) < self.buffer_count
            ):
                reads[next_read] = self._issue_reads(arrivals.at(next_read))
                next_read += 1
            t0 = time.perf_counter()
            master, exp_avg, exp_avg_sq, grad = (f.result() for f in reads.pop(k))
            t1 = time.perf_counter()
            self._update(i, master, exp_avg, exp_avg_sq, grad, lr, grad_scale)
            t2 = time.perf_counter()
            self.tm.record_span(f"adam {self.groups[i].name}", "adam", t1, t2, step=self.step_count)
            self._pending.append((i, self._writer.submit(self._issue_writes, i)))
            while (
                self._pending
                and self._pending[0][1].done()
                and all(f.done() for f in self._pending[0][1].result())
            ):
                t_write += self._retire_in_step()
            t_read += t1 - t0
            t_comp += t2 - t1
            k += 1
        t3 = time.perf_counter()
        for _, cf in self._pending:
            # every evict must be claimed before the next forward can pin a partition again
            cf.result(timeout=self._timeout_s)
        t_write += time.perf_counter() - t3
        return {"read_wait_s": t_read, "compute_s": t_comp, "write_wait_s": t_write}

    def _issue_reads(self, i: int) -> list[TierFuture]:
        plan = self.plans[i]
        return [self.tm.fetch(p, plan.compute_tier) for p in self.states[i]] + [
            self.tm.fetch(self._grads[i], plan.compute_tier)
        ]

    def _update(
        self,
        i: int,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor,
        lr: float,
        grad_scale: float,
    ) -> None:
        g, plan = self.groups[i], self.plans[i]
        ext = _kernels()
        runs = self.param_steps[i].runs(self._masks.get(i))
        alias = i in self._param_is_master  # [Note: fp32 master is the parameter]: updated in place
        lowp = self.compute_dtype != torch.float32
        out = None if alias else self.tm.allocate(g.param, plan.stage_tier).result()
        if lowp and out is not None and out.device != master.device:
            raise RuntimeError(f"group {g.name}: staging buffer on {out.device}, master on {master.device}")
        if len(runs) == 1 and runs[0].stepped:  # the whole shard alike: one tensor, as ever
            kw = self._kernel_args(runs[0], lr, grad_scale)
            if out is None:
                ext.adam_step(master, grad, exp_avg, exp_avg_sq, **kw)
            elif plan.side == "cpu":
                ext.adam_step(master, grad, exp_avg, exp_avg_sq, out_lowp=out if lowp else None, **kw)
            else:
                ext.gpu_adam_step(
                    [master], [grad], [exp_avg], [exp_avg_sq], out_lowp=[out] if lowp else None, **kw
                )
        else:
            self._step_runs(
                runs, plan.side, master, grad, exp_avg, exp_avg_sq, out if lowp else None, lr, grad_scale
            )
        if out is not None and not lowp:
            out.copy_(master)

    def _kernel_args(self, run: Run, lr: float, grad_scale: float) -> dict[str, Any]:
        return dict(
            step=self.step_count - run.lag,
            lr=float(lr) * run.hyper.lr_scale,
            beta1=float(self.opt.betas[0]),
            beta2=float(self.opt.betas[1]),
            eps=float(self.opt.eps),
            weight_decay=float(run.hyper.weight_decay),
            adamw_mode=bool(self.opt.adamw_mode),
            grad_scale=float(grad_scale),
        )

    def _step_runs(
        self,
        runs: Sequence[Run],
        side: str,
        master: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        out_lowp: torch.Tensor | None,
        lr: float,
        grad_scale: float,
    ) -> None:
        """Step a shard run by run (one kernel call per distinct hyper-parameter set, each run a
        tensor with its own step count); skipped runs only refresh the compute-dtype copy."""
        ext = _kernels()
        by_hyper: dict[ParamHyper, list[Run]] = {}
        for r in runs:
            if r.stepped:
                by_hyper.setdefault(r.hyper, []).append(r)
            elif out_lowp is not None:  # a fresh staging buffer: it must hold the unchanged values
                out_lowp[r.start : r.stop].copy_(master[r.start : r.stop])
        for hyper_runs in by_hyper.values():
            kw = self._kernel_args(hyper_runs[0], lr, grad_scale)
            del kw["step"]

            def cut(t: torch.Tensor) -> list[torch.Tensor]:
                return [t[r.start : r.stop] for r in hyper_runs]  # noqa: B023 (used at once)

            outs = cut(out_lowp) if out_lowp is not None else None
            steps = [self.step_count - r.lag for r in hyper_runs]
            if side == "cpu":
                ext.check_scalars(step=min(steps), **{k: v for k, v in kw.items() if k != "adamw_mode"})
                ext._adam_step_many(
                    cut(master), cut(grad), cut(exp_avg), cut(exp_avg_sq), steps=steps, out_lowp=outs, **kw
                )
            else:
                ext.gpu_adam_step(
                    cut(master), cut(grad), cut(exp_avg), cut(exp_avg_sq), step=steps, out_lowp=outs, **kw
                )

    def _issue_writes(self, i: int) -> list[TierFuture]:
        g, plan = self.groups[i], self.plans[i]
        tm, futs = self.tm, []
        alias = i in self._param_is_master
        for part in self.states[i][1:] if alias else self.states[i]:
            if not (plan.compute_tier == plan.state_home and part.valid_in() == {plan.state_home}):
                # (an in-place update of the only copy, at home in memory, needs no bookkeeping)
                tm.mark_dirty(part, plan.compute_tier)
            tm.release(part, plan.compute_tier)
            if plan.compute_tier != plan.state_home:
                futs.append(tm.evict(part, plan.compute_tier))
        grad = self._grads[i]
        tm.release(grad, plan.compute_tier)
        if plan.compute_tier != grad.home:
            futs.append(tm.evict(grad, plan.compute_tier))  # clean: free
        # the new parameter: in the staging tier, or (alias) in the compute tier the master came to
        new_in = plan.compute_tier if alias else plan.stage_tier
        if alias and not (new_in == g.param.home and g.param.valid_in() == {new_in}):
            tm.mark_dirty(g.param, new_in)
        tm.release(g.param, new_in)
        if new_in != g.param.home and i not in self._keep_in_cpu:  # see [Note: max_in_cpu]
            futs.append(tm.evict(g.param, new_in))
        if self.on_params_written is not None:
            self.on_params_written(g)
        return futs

    def _retire_oldest(self) -> float:
        _, cf = self._pending.popleft()  # first: whatever fails below, wait_writes' loop ends
        t0 = time.perf_counter()
        first: BaseException | None = None
        for f in cf.result(timeout=self._timeout_s):
            try:  # every write of the group ends before its error is raised: none is left behind
                f.result()
            except Exception as e:  # noqa: BLE001 - re-raised below, after the others
                first = first or e
        if first is not None:
            raise first
        return time.perf_counter() - t0

    def _retire_in_step(self) -> float:
        """`_retire_oldest` inside a step, whose error waits for `wait_writes`: the step's other
        groups still update ([Note: a failed write-back is retried by flush])."""
        try:
            return self._retire_oldest()
        except Exception as e:  # noqa: BLE001 - raised by the next wait_writes
            self._write_errors.append(e)
            return 0.0

    def wait_writes(self) -> float:
        """Block until every write-back issued by a step has finished; returns seconds waited.
        A failed one raises, once, after all the others ended: see
        [Note: a failed write-back is retried by flush]."""
        waited = 0.0
        errors, self._write_errors = self._write_errors, []
        while self._pending:
            try:
                waited += self._retire_oldest()
            except Exception as e:  # noqa: BLE001 - the first is raised below
                errors.append(e)
        if errors:
            if len(errors) > 1:
                log.error(
                    "%d more optimizer write-backs failed as well (the first is raised)", len(errors) - 1
                )
            raise errors[0]
        return waited

    def close(self) -> None:
        """Wait for the write-backs in flight and stop the worker threads. Idempotent."""
        try:
            self.finish_overlapped_step(abort=True)
            self.wait_writes()
        finally:
            self._stepper.shutdown(wait=True)
            self._writer.shutdown(wait=True)

    # ---- introspection ---------------------------------------------------------------------
    def state_partitions(self, group: ShardGroup) -> StatePartitions:
        """`group`'s master / exp_avg / exp_avg_sq partitions (checkpoints); the step count they
        belong to is `step_count`."""
        return self.states[self._index[group.name]]

    def master_shard(self, group_index: int) -> torch.Tensor:
        """A host copy of one group's fp32 master shard (tests, checkpoints)."""
        part = self.states[group_index][0]
        tier = self.plans[group_index].compute_tier
        t = self.tm.fetch(part, tier).result()
        try:
            return t.detach().to("cpu", copy=True)
        finally:
            self.tm.release(part, tier)

    def checkpoint_partitions(self) -> dict[str, dict[str, Any]]:
        """For checkpoints (tiered/checkpoint): group name -> {"master", "exp_avg", "exp_avg_sq":
        Partition}; "master" is the group's parameter partition where that partition is the
        master (see [Note: fp32 master is the parameter])."""
        return {g.name: parts._asdict() for g, parts in zip(self.groups, self.states, strict=True)}

    def param_step_counts(self) -> dict[str, int]:
        """Per parameter name: its own step count (checkpoints; equal to `step_count` for every
        parameter that got a gradient in every step). See [Note: parameters without a gradient
        are not stepped]."""
        out: dict[str, int] = {}
        for steps in self.param_steps:
            out.update(steps.steps(self.step_count))
        return out

    def load_param_step_counts(self, counts: Mapping[str, int] | None) -> None:
        """Set the per-parameter step counts (after `step_count`); None (an older checkpoint):
        every parameter counts every step."""
        for steps in self.param_steps:
            steps.load_steps(counts or {}, self.step_count)

    def stats(self) -> dict[str, Any]:
        return {
            "groups_cpu": sum(p.side == "cpu" for p in self.plans),
            "groups_gpu": sum(p.side == "gpu" for p in self.plans),
            "buffer_count": self.buffer_count,
            "step_count": self.step_count,
            "last_step": dict(self.last_step),
            "total": dict(self._totals),
        }
