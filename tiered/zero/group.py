"""One shard group at run time: its gather, release, prefetch, eviction and gradient flush.

`GroupRuntime` is to a `ShardGroup` what FSDP2's FSDPParamGroup is to its parameters: it owns
the group's mutable state (pins, the gathered buffer, the fetch and eviction in flight, the
gradients seen in this backward) and does the group's own moves through the TierManager. What
spans groups (which group next, the pass, the module maps) is the coordinator's
(tiered/zero/coordinator.py); the elements live in "gpu" are the `LiveBudget`'s.

[Note: home views]
A partition's home copy never leaves its home tier (the manager only drops it with the
partition). Where that home is memory-like (parameters homed in "gpu" on one rank; gradients,
always homed in "gpu" or "cpu"), the resident home tensor is therefore stable, and going
through the manager's loop thread for every gather, release and gradient add would cost a
cross-thread round trip each, for no movement at all. A group takes each such tensor once
(fetch, release) and uses it directly; it still calls ``mark_dirty`` whenever another tier
holds a copy (which the write makes stale), so the manager's view stays exact.

[Note: gradient flush]
Each managed parameter that requires grad carries a post-accumulate-grad hook. When every such
parameter of a group has its gradient for this backward, the group is *flushed*: its gradients
are added (fp32) into the group's gradient partition in its home tier (see [Note: home views]),
after a reduce-scatter (rank average) when world_size > 1; then
``param.grad`` is dropped and the group's backward gather is released. Groups that are only
partly complete at the end of backward (unused parameters) are flushed by `finish_backward`,
missing gradients counting as zeros; with world_size > 1 the ranks first agree which groups
any of them still holds (one small all-reduce) and all flush those. Mid-backward flushes happen in
graph order, the same on every rank when the graphs agree; where they cannot (routing, branches),
a leaf module flushes its groups together at its boundary ([Note: leaf modules] in
tiered/zero/leaf.py), and [Note: collective order check] turns any other divergence into an
error. Each flush
also records which entries got a gradient (``received``, OR-ed over the accumulation window): the
optimizer does not step the others ([Note: parameters without a gradient are not stepped] in
tiered/optim/runs.py). Adding
into the accumulated fp32 shard is exactly what plain PyTorch's ``param.grad`` accumulation does
in fp32, so gradient accumulation stays bitwise equal.

[Note: lazy gradient zeroing]
``zero_grads`` only marks the groups; the first flush of a group after it *copies* the gradient
into the partition (padding and missing gradients written as zeros) instead of adding it to
zeros: one pass over the partition fewer and a lighter one (on benchmarks/step.py: a 143 MB
memset and a read stream per step). ``0 + g`` and ``g`` are equal except for the sign of a zero,
which is then plain PyTorch's. Groups no gradient reached are zeroed for real at the end of
backward, before anything (the norm, the optimizer) reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from tiered.errors import ShapeMutationError
from tiered.shards import ShardGroup
from tiered.zero import comm
from tiered.zero.budget import LiveBudget
from tiered.zero.counters import ScheduleCounters
from tiered.zero.grad_home import GradKeeper, StagedGradHome, is_staged
from tiered.zero.leaf import passed_over
from tiered.zero.order import GATHER, REDUCE, CollectiveOrder
from tiered.zero.split import SplitParam, drop_grad, empty, grad_of, pieces_by_entry, put

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from tiered.tiers import Partition, TierFuture, TierManager


@dataclass(frozen=True)
class GradSummary:
    found_inf: bool
    """Some accumulated gradient element is inf or NaN (fp16 overflow: skip the step)."""
    sq_norm_local: float
    """Squared L2 norm of this rank's shard of the accumulated fp32 gradients."""
    nonfinite_group: str | None = None
    """The first group whose gradient holds inf or NaN (from the norm, or from the finiteness
    probe when no norm was computed); None when all are finite or nothing looked."""


@dataclass(frozen=True)
class GroupContext:
    """What every group of one model shares: where and how it is gathered."""

    tm: TierManager
    budget: LiveBudget
    counters: ScheduleCounters
    """Schedule counters (fetches, prefetch_hits, evictions, grad_flushes, ...), their one writer."""
    device: torch.device
    compute_dtype: torch.dtype
    placeholder: torch.Tensor
    """The empty tensor a released parameter's ``.data`` points at."""
    world_size: int
    process_group: ProcessGroup | None
    param_tier: str
    max_reuse_numel: int
    next_use_distance: Callable[[int], int | None]
    """Elements gathered before a group is used again in this pass (the trace); None if not again."""
    order: CollectiveOrder | None = None
    """With several ranks: the ranks agree on each collective first ([Note: collective order check])."""
    splits: Mapping[int, SplitParam] = field(default_factory=dict)
    """id(param) -> the parameter planned in pieces ([Note: fused parameters in pieces] in tiered/zero/split.py)."""


class GroupRuntime:
    """The run-time state and moves of one shard group. See the module docstring."""

    def __init__(
        self,
        ctx: GroupContext,
        group: ShardGroup,
        params: list[nn.Parameter],
        *,
        needs_fetch: bool,
        initial_fp32: torch.Tensor | Callable[[], torch.Tensor] | None = None,
    ) -> None:
        self.ctx = ctx
        self.group = group
        self.index = group.index
        self.numel = group.numel
        self.params = params
        """The group's nn.Parameters, in entry order."""
        self.n_req_grad = sum(1 for p in params if p.requires_grad)
        self.needs_fetch = needs_fetch
        """False when the home copy is the gathered buffer (homed in "gpu" on one rank)."""
        self.counted_live = needs_fetch and not group.persistent
        """Counted against the live budget: see [Note: the live budget]."""
        self.pins = 0
        self.full: torch.Tensor | None = None
        """The gathered full buffer the parameters view, while pins > 0."""
        self.inflight: TierFuture[torch.Tensor] | TierFuture[None] | None = (
            None  # a fetch or prefetch not yet consumed
        )
        self.evicting: TierFuture[None] | None = None  # an eviction issued at release, not yet awaited
        self.full_part: Partition | None = None  # world_size > 1: the gathered full buffer's partition
        self.grads_seen: set[int] = set()
        """ids of the parameters whose gradient arrived in this backward."""
        self.grad_zero_pending = group.grad is not None
        self.received = torch.zeros(len(group.entries), dtype=torch.uint8)
        """Per entry (uint8): a gradient reached it in this accumulation window (``p.grad`` set at
        some flush). See [Note: parameters without a gradient are not stepped] in tiered/optim/runs.py."""
        """The gradient partition is logically zero: see [Note: lazy gradient zeroing]."""
        self.finite_probes: list[torch.Tensor] | None = None
        """With the finiteness probe on (`ZeroParameters.probe_finite_grads`): one 0-dim fp32 sum
        per flush, not read yet (see `_probe`); a staged gradient home needs none (its squared
        norm is kept anyway). See [Note: non-finite steps] in tiered/engine/nonfinite.py."""
        self._home_views: dict[str, torch.Tensor] = {}
        self._initial_fp32 = initial_fp32
        self._initial_taken = False
        self.keep_flushed_grads = False
        """A flushed gradient homed in storage stays in "cpu" for the step to consume
        (`ZeroParameters.keep_flushed_grads`: [Note: gradient consumed from memory])."""
        self._staged_grad = (  # a gradient home in storage: [Note: gradients on nvme]
            StagedGradHome(ctx.tm, group, group.grad)
            if group.grad is not None and is_staged(ctx.tm, group.grad)
            else None
        )
        self.pieces = pieces_by_entry(group.entries, params, ctx.splits)
        """Entry index -> its parameter, for the entries that are pieces of one."""

    def keep_grads_for_step(self, keeper: GradKeeper | None, *, enabled: bool) -> None:
        """`keep_flushed_grads`, and who admits and learns of the kept gradients (a staged home)."""
        self.keep_flushed_grads = enabled
        if self._staged_grad is not None:
            self._staged_grad.keeper = keeper

    # ---- home copies -----------------------------------------------------------------------
    def home_view(self, part: Partition, *, overwrite: bool = False, for_step: bool = False) -> torch.Tensor:
        """The stable resident home tensor of `part` (this group's param or grad). See [Note: home views].
        `overwrite`: the caller writes all of it (a staged gradient is then not read first);
        `for_step`: a flush, whose staged gradient may be kept for the step."""
        if self._staged_grad is not None and part is self._staged_grad.part:
            return self._staged_grad.open(overwrite=overwrite, keeping=for_step and self.keep_flushed_grads)
        t = self._home_views.get(part.name)
        if t is None:
            tm = self.ctx.tm
            t = tm.fetch(part, part.home).result()
            tm.release(part, part.home)
            self._home_views[part.name] = t
        return t

    def forget_home_views(self) -> None:
        """Drop the cached home tensors (their partitions were dropped at close: the bytes must
        be able to leave, [Note: restore at close group by group])."""
        self._home_views.clear()

    def _home_written(self, part: Partition, *, for_step: bool = False) -> None:
        """The home copy was modified in place: tell the manager if another copy went stale.
        `for_step`: a flushed gradient the optimizer step will read next (a staged one stays in
        "cpu" where `keep_flushed_grads` says so)."""
        if self._staged_grad is not None and part is self._staged_grad.part:
            self._staged_grad.write_back(keep=for_step and self.keep_flushed_grads)
            return
        if part.valid_in() != frozenset((part.home,)):
            self.ctx.tm.mark_dirty(part, part.home)

    def take_initial_fp32(self) -> torch.Tensor:
        """fp32 master values of this rank's shard, as partitioned. Once (freed after)."""
        g, tm = self.group, self.ctx.tm
        if self._initial_taken:
            raise RuntimeError(f"initial_fp32_shard({g.name}) was already taken (it is freed after one call)")
        self._initial_taken = True
        if self._initial_fp32 is not None:
            t, self._initial_fp32 = self._initial_fp32, None
            # a function: the shard read again from the weight files ([Note: streaming load])
            return t if isinstance(t, torch.Tensor) else t()
        was_resident = g.param.state("gpu").resident
        t = tm.fetch(g.param, "gpu").result()
        try:
            return t.detach().to("cpu", torch.float32, copy=True)
        finally:
            tm.release(g.param, "gpu")
            if not was_resident and g.param.home != "gpu":  # not counted live: do not leave it
                tm.evict(g.param, "gpu").result()

    # ---- gather ------------------------------------------------------------------------------
    def start_fetch(self) -> TierFuture[torch.Tensor] | torch.Tensor:
        """Count and issue the fetch of this rank's shard into "gpu" (marking it live); returns
        the fetch, or the home shard itself where that is the gathered buffer."""
        g, ctx = self.group, self.ctx
        if not self.needs_fetch:
            if not g.param.is_resident(g.param.home):  # newer bytes elsewhere: bring them home
                ctx.tm.flush(g.param).result()
            return self.home_view(g.param)
        prefetched = self.inflight is not None
        ctx.counters.count_fetch(prefetched=prefetched, cached=not prefetched and g.param.is_resident("gpu"))
        fut = ctx.tm.fetch(g.param, "gpu")
        self.inflight = fut  # the manager may not have started it yet: not "absent" for settle_live
        if self.counted_live:
            ctx.budget.add(self.index)
        return fut

    def finish_gather(self, fetch: TierFuture[torch.Tensor] | torch.Tensor) -> None:
        """Wait for the shard, assemble the full buffer and point the parameters at it."""
        if isinstance(fetch, torch.Tensor):
            shard = fetch
        else:
            shard = fetch.result()
            self.inflight = None
        full = self._assemble_full(shard)
        ctx = self.ctx
        with torch.no_grad():
            for j, (e, p) in enumerate(zip(self.group.entries, self.params, strict=True)):
                split = self.pieces.get(j)
                if (
                    p.data.numel() != 0 and (split is None or not split.holds(p.data))
                ) or p.dtype != ctx.compute_dtype:
                    raise ShapeMutationError(
                        f"parameter {e.name!r} was replaced outside tiered (now shape {tuple(p.shape)}, "
                        f"dtype {p.dtype}; tiered manages it as shape {e.shape}): do not assign .data of "
                        "parameters of a tiered model; build the model with its final shapes before initialize"
                    )
                put(p, e, split, full[e.offset : e.offset + e.numel], self.index)
        self.full = full
        self.pins = 1
        ctx.budget.gathered[self.index] = None
        ctx.budget.note_peaks()

    def _assemble_full(self, shard: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        if ctx.world_size == 1:
            return shard
        g, tm = self.group, ctx.tm
        if self.full_part is None:
            home = "cpu" if "cpu" in tm.tier_names else ctx.param_tier
            self.full_part = tm.create(f"{g.name}.full", g.full_numel, ctx.compute_dtype, home)
        full = tm.allocate(self.full_part, "gpu").result()
        if ctx.order is not None:
            ctx.order.agree(GATHER, self.index)
        comm.all_gather_into(full, shard, ctx.process_group)
        return full

    # ---- release / evict ---------------------------------------------------------------------
    def release(self) -> None:
        """Drop one pin; at zero, empty the parameters and let go of the gathered copy (evicted
        in the background unless it is reused soon)."""
        g, ctx = self.group, self.ctx
        if self.pins <= 0:
            raise AssertionError(f"group {g.name} released more often than gathered")
        self.pins -= 1
        if self.pins:
            return
        with torch.no_grad():
            for j, (e, p) in enumerate(zip(g.entries, self.params, strict=True)):
                if tuple(p.shape) != e.shape:
                    raise ShapeMutationError(
                        f"parameter {e.name!r} changed shape from {e.shape} to {tuple(p.shape)} while in use: "
                        "tiered partitions parameters with fixed shapes; do not reassign .data or resize them"
                    )
                empty(p, self.pieces.get(j), ctx.placeholder, self.index)
        self.full = None
        ctx.budget.gathered.pop(self.index, None)
        if self.needs_fetch:
            ctx.tm.release(g.param, "gpu")
        if self.full_part is not None:
            ctx.tm.release(self.full_part, "gpu")
            ctx.tm.evict(self.full_part, "gpu").result()
        if self.counted_live:
            d = ctx.next_use_distance(self.index)
            if d is None or d > ctx.max_reuse_numel:
                self.evict(wait=False)

    def wants_prefetch(self) -> bool:
        """Not gathered, not on its way and not already in "gpu"."""
        return (
            self.needs_fetch
            and self.pins == 0
            and self.inflight is None
            and not self.group.param.is_resident("gpu")
        )

    def prefetch(self, *, keep: int, beyond: float) -> bool:
        """Start moving the shard into "gpu" ahead of its use, within the live budget (evicting
        only groups used after `beyond` elements, never `keep`); False when it does not fit."""
        ctx = self.ctx
        if not self.group.persistent:
            if not ctx.budget.is_live(self.index) and not ctx.budget.make_room(
                self.numel, keep=keep, beyond=beyond
            ):
                return False
            ctx.budget.add(self.index)
        self.inflight = ctx.tm.prefetch(self.group.param, "gpu")
        ctx.counters.count_prefetch()
        return True

    def forget_prefetch(self) -> None:
        """Wait for a fetch in flight and drop it (its bytes may be stale after a step)."""
        if self.inflight is not None:
            self.inflight.result()
            self.inflight = None

    def evict(self, *, wait: bool = True) -> None:
        """Evict the copy in "gpu". With wait=False (at release) the eviction runs in the
        background; the group stays counted live until it completed (see settle_live)."""
        self.forget_prefetch()
        # (a shard homed in "gpu", world_size > 1, stays: only the gathered full buffer goes)
        if self.evicting is None and self.group.param.home != "gpu" and self.group.param.is_resident("gpu"):
            self.evicting = self.ctx.tm.evict(self.group.param, "gpu")
            self.ctx.counters.count_eviction()
        if wait:
            self.wait_evicted()

    def wait_evicted(self) -> None:
        """Wait for the background eviction, if any (raising its error); no longer live."""
        if self.evicting is not None:
            fut, self.evicting = self.evicting, None
            fut.result()
        self.ctx.budget.discard(self.index)

    def settle_live(self) -> None:
        """Leave the live set if the copy in "gpu" is gone (see LiveBudget.prune)."""
        if self.evicting is not None and self.evicting.done():
            self.wait_evicted()  # raises here if the background eviction failed
        # state().resident includes a copy still loading (a fetch in flight) or being evicted
        elif self.pins == 0 and self.inflight is None and not self.group.param.state("gpu").resident:
            self.ctx.budget.discard(self.index)  # the manager evicted it under budget pressure

    # ---- gradients: see [Note: gradient flush] -------------------------------------------------
    def grad_arrived(self, p: nn.Parameter) -> bool:
        """Record `p`'s gradient of this backward; True once every grad-requiring parameter's came."""
        self.grads_seen.add(id(p))
        return len(self.grads_seen) >= self.n_req_grad

    def passed_over(self) -> list[str]:
        """Names of the trainable parameters without a gradient in this backward, if some others
        of the group have one (a partly complete group: a routed-around expert); else []."""
        return passed_over(self.group.entries, self.params, self.grads_seen)

    def has_unflushed_grads(self) -> bool:
        # also grads set without the hook firing (retain_graph reuse)
        return bool(self.grads_seen) or any(
            p.grad is not None and (j not in self.pieces or self.pieces[j].unflushed(self.index))
            for j, p in enumerate(self.params)
        )

    def flush_grads(self) -> None:
        """Add this backward's gradients (fp32, rank-averaged) into the gradient partition and
        drop ``param.grad``. See [Note: gradient flush] and [Note: lazy gradient zeroing]."""
        g, ctx = self.group, self.ctx
        assert g.grad is not None
        pairs = enumerate(zip(g.entries, self.params, strict=True))
        grads = [(e, grad_of(p, e, self.pieces.get(j))) for j, (e, p) in pairs]
        self.received |= torch.tensor([gr is not None for _, gr in grads], dtype=torch.uint8)
        fresh, self.grad_zero_pending = self.grad_zero_pending, False
        with torch.no_grad():
            if ctx.world_size == 1:
                t = self.home_view(
                    g.grad, overwrite=fresh, for_step=True
                )  # fresh: every element is written below
                for e, gr in grads:
                    dst = t[e.offset : e.offset + e.numel]
                    if gr is not None:
                        dst.copy_(gr.reshape(-1)) if fresh else dst.add_(gr.reshape(-1).to(t.device))
                    elif fresh:
                        dst.zero_()
                if fresh:
                    t[g.numel :].zero_()  # alignment padding (entries fill [0, numel) in order)
                self._probe([gr for _, gr in grads if gr is not None], t[: g.numel])
                self._home_written(g.grad, for_step=True)
            else:
                dev = next((gr.device for _, gr in grads if gr is not None), ctx.device)
                full = torch.zeros(g.full_numel, dtype=torch.float32, device=dev)
                for e, gr in grads:
                    if gr is not None:
                        full[e.offset : e.offset + e.numel].copy_(gr.reshape(-1))
                if ctx.order is not None:
                    ctx.order.agree(REDUCE, self.index)
                shard = comm.reduce_scatter_mean(full, ctx.process_group)
                t = self.home_view(g.grad, overwrite=fresh, for_step=True)
                t.copy_(shard) if fresh else t.add_(shard.to(t.device))
                self._probe([shard], t)  # this rank's shard; the engine ORs the ranks
                self._home_written(g.grad, for_step=True)
        self.drop_param_grads()
        ctx.counters.count_grad_flush()

    def _probe(self, incoming: list[torch.Tensor], home: torch.Tensor) -> None:
        """Record whether this flush's values are finite, without a sync: a sum is finite iff
        every element is (short of an fp32 overflow, counted as non-finite too). Summed where it
        reads least: the incoming gradients on a CUDA device (16-bit, in device memory), else
        the fp32 home just written (on a CPU, reductions over 16-bit values are slow)."""
        if self.finite_probes is None or self._staged_grad is not None or not incoming:
            return
        if incoming[0].is_cuda:
            s = torch.stack([gr.sum() for gr in incoming]).float().sum()
        else:
            s = home.sum()
        self.finite_probes.append(s)

    def drop_param_grads(self, *, flushed: bool = True) -> None:
        """Drop this backward's gradients (`flushed`: added to the partition; a parameter in
        pieces keeps its gradient until every piece's group took its slice)."""
        for j, p in enumerate(self.params):
            drop_grad(p, self.pieces.get(j), self.index, flushed=flushed)
        self.grads_seen.clear()

    def zero_grads_lazily(self) -> None:
        """The accumulated gradient is zero from now on (written at the first flush or at the
        end of backward) and this backward's gradients are forgotten."""
        if self.group.grad is not None:
            self.grad_zero_pending = True
        self.received.zero_()
        self.drop_param_grads(flushed=False)

    def zero_pending_grad(self) -> None:
        """Write the zeros a lazily zeroed gradient partition stands for."""
        if self.grad_zero_pending and self.group.grad is not None:
            self.home_view(self.group.grad, overwrite=True).zero_()
            self._home_written(self.group.grad)
        self.grad_zero_pending = False

    @property
    def grad_staged(self) -> bool:
        """The gradient's home is storage: [Note: gradients on nvme]."""
        return self._staged_grad is not None

    @property
    def staged_norms(self) -> list[tuple[str, torch.Tensor]]:
        """A staged gradient's per-parameter norms, kept at each flush (nothing read)."""
        assert self._staged_grad is not None
        return self._staged_grad.norms

    def read_grad_shard(self) -> torch.Tensor:
        """A CPU copy of this rank's accumulated fp32 gradient shard."""
        g = self.group
        if g.grad is None:
            raise ValueError(f"group {g.name} is frozen (requires_grad=False): it has no gradient")
        if self.grad_zero_pending:
            return torch.zeros(g.shard_numel, dtype=torch.float32)
        if self._staged_grad is not None:
            return self._staged_grad.read_copy()
        return self.home_view(g.grad).detach().to("cpu", copy=True)
