"""ZeroParameters: the per-model coordinator of every partitioned parameter.

It builds the flat shard groups (sharding.py, [Note: flat shard groups]), holds one `GroupRuntime`
per group (group.py: its gather, release, prefetch, eviction and gradient flush), their shared
`LiveBudget` (budget.py) and the recorded `Trace`; it installs the hooks (hooks.py,
[Note: hooks that only dispatch]) and keeps what spans groups: the module -> group maps, the
forward stack, the groups held for backward or sealed for an overlapped step, the counters. Which
group next is the trace's business ([Note: trace and re-synchronisation]). The modules import one
way: shards < budget < group < saved, leaf < order < group, hooks < passes < coordinator; plan,
meta, schedule, comm and sharding import none of the run-time objects. What a leaf gathers and
flushes is [Note: leaf modules] in leaf.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tiered.errors import CapacityError, ConfigError, ShapeMutationError
from tiered.shards import ShardGroup
from tiered.zero import comm, grad_norm
from tiered.zero.budget import GpuGatherNeed, LiveBudget
from tiered.zero.counters import ScheduleCounters
from tiered.zero.group import GradSummary, GroupContext, GroupRuntime
from tiered.zero.hooks import CallInBackward, HookSet
from tiered.zero.layout import persists_by_room, plan_layout
from tiered.zero.leaf import local_context
from tiered.zero.order import CollectiveOrder, masks_over_ranks, union_over_ranks
from tiered.zero.passes import BackwardHolds, PassState
from tiered.zero.plan import check_no_meta_mix
from tiered.zero.saved import RecomputeParams, SavedTensorRefs
from tiered.zero.schedule import BeladyPolicy, Trace
from tiered.zero.sharding import ALIGNMENT_NUMEL, move_buffers, own_param_ids, write_group_partitions
from tiered.zero.split import make_splits, params_once, units_of

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from tiered.config.schema import TieredConfig
    from tiered.tiers import TierManager
    from tiered.zero.grad_home import GradKeeper
    from tiered.zero.load import LoadPlan

log = logging.getLogger(__name__)

__all__ = ["ALIGNMENT_NUMEL", "GradSummary", "ZeroParameters"]


class ZeroParameters:
    """Partitions `model`'s parameters into shard groups in `tm` and schedules them."""

    def __init__(
        self,
        model: nn.Module,
        tm: TierManager,
        cfg: TieredConfig,
        *,
        param_tier: str,
        grad_tier: str,
        compute_dtype: torch.dtype,
        process_group: ProcessGroup | None = None,
        weights: LoadPlan | None = None,
        gpu_stepped_grad_tier: str | None = None,
    ) -> None:
        z = cfg.zero
        self.model = model
        self.tm = tm
        self.cfg = cfg
        self.param_tier = param_tier
        self.grad_tier = grad_tier
        self.compute_dtype = compute_dtype
        self.process_group = process_group
        self.world_size, self.rank = comm.world(process_group)
        self._param_order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        """Where each parameter comes in model.parameters(): the order torch stacks the norms in."""
        for t in (param_tier, grad_tier, "gpu"):
            if t not in tm.tier_names:
                raise ConfigError(
                    f"tier {t!r} is not configured (tiers: {tm.tier_names}); add it under tiered.tiers"
                )
        self.device = torch.device(tm.tier("gpu").backend.capabilities.device)
        if self.device.type == "cuda" and self.device.index is None:  # compare equal to tensors' devices
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._prefetch_numel = z.prefetch_bucket_size_numel
        self.busy = False
        """Set while the coordinator moves parameters itself (ExternalParamMode stands aside)."""
        placeholder = torch.empty(0, dtype=compute_dtype, device=self.device)
        self.counters = ScheduleCounters()  # [Note: one writer of the schedule counters]

        ws = self.world_size
        is_meta = check_no_meta_mix(model)
        layout = plan_layout(  # before any partition is written: fail fast
            model,
            z,
            gpu_budget_bytes=tm.budget_bytes("gpu"),
            compute_dtype=compute_dtype,
            world_size=ws,
            param_tier=param_tier,
            grad_tier=grad_tier,
            persist_by_room=persists_by_room(cfg),
            accumulation=int(cfg.gradient_accumulation_steps),
            gpu_stepped_grad_tier=gpu_stepped_grad_tier,
        )
        planned = layout.planned
        needs_fetch = ws > 1 or param_tier != "gpu"
        self.managed: dict[int, tuple[int, int]] = layout.managed  # id(param) -> (group index, entry index)
        self._pieces = layout.pieces  # [Note: fused parameters in pieces] in tiered/zero/split.py
        self._modules = layout.modules
        self._leaves = layout.leaves
        self._extra_groups: dict[int, list[int]] = {}  # module -> groups it used from elsewhere
        self.gpu_need: GpuGatherNeed = layout.gpu_need
        """Bytes the schedule holds in "gpu" at its peak (the engine's capacity check uses it)."""
        written = write_group_partitions(
            model,
            planned,
            tm,
            param_tier=param_tier,
            grad_homes=layout.grad_homes,
            compute_dtype=compute_dtype,
            world_size=ws,
            rank=self.rank,
            is_meta=is_meta,
            placeholder=placeholder,
            weights=weights,
        )
        del planned
        self.splits = make_splits(self._pieces, [(w.params, w.group.entries) for w in written])
        """id(param) -> a parameter planned in pieces, and its whole buffer while gathered."""
        self.groups: list[ShardGroup] = [w.group for w in written]
        """Every group, in (initial) execution order: the interface to the optimizer and checkpoints."""
        self._order = (  # [Note: collective order check] in tiered/zero/order.py
            CollectiveOrder(process_group, model, self.groups, self._divergence)
            if ws > 1 and cfg.tiered.check_collective_order
            else None
        )
        self.trace = Trace([g.numel for g in self.groups])
        self.budget = LiveBudget(
            z.max_live_parameters_numel, [g.numel for g in self.groups], self.trace.next_use_distance
        )
        ctx = GroupContext(
            tm,
            self.budget,
            self.counters,
            self.device,
            compute_dtype,
            placeholder,
            ws,
            process_group,
            param_tier,
            z.max_reuse_distance_numel,
            self.trace.next_use_distance,
            self._order,
            self.splits,
        )
        self.runtimes: list[GroupRuntime] = [
            GroupRuntime(ctx, w.group, w.params, needs_fetch=needs_fetch, initial_fp32=w.initial_fp32)
            for w in written
        ]
        """One per group, by index: its gather/release state and gradient accumulation."""
        del written
        self.budget.bind(self.runtimes)
        move_buffers(model, self.device, is_meta=is_meta)
        if weights is not None:
            weights.load_buffers(model)

        part_group = {g.param.name: g.index for g in self.groups}
        tm.set_eviction_policy(
            "gpu", BeladyPolicy(part_group.get, self.trace, lambda i: self.groups[i].persistent)
        )
        self._fw_stack: list[nn.Module] = []
        self._fw_pins: dict[int, list[list[int]]] = {}
        self._bw = BackwardHolds(self._gather, self._release, self.runtimes)
        saved = SavedTensorRefs(
            self.runtimes, self.managed, self.budget, self.counters, self.device, self._bw.gather, self.splits
        )
        self._pass = PassState(self.trace, self.runtimes, self._bw, self, saved)
        self._recompute = RecomputeParams(self.managed)  # [Note: recomputed frozen parameters]
        self._recompute_mods: list[int] = []
        self._grad_callbacks: list[Callable[[ShardGroup], None]] = []
        groups_params = [(rt.params, rt.group.entries) for rt in self.runtimes]
        self._hooks = HookSet(self, model, *params_once(groups_params))  # (a parameter in pieces: once)
        log.info(
            "partitioned %d parameters into %d groups (%d persistent), world_size=%d",
            sum(g.numel for g in self.groups),
            len(self.groups),
            sum(g.persistent for g in self.groups),
            ws,
        )

    # ---- public ------------------------------------------------------------------------------
    def initial_fp32_shard(self, group: ShardGroup) -> torch.Tensor:
        """fp32 master values of this rank's shard of `group`, as partitioned. Once per group."""
        return self.runtimes[group.index].take_initial_fp32()

    def params_updated(self) -> None:
        """The optimizer wrote new parameter values (through the manager, which invalidated stale
        copies): forget prefetches issued before, and recount what is still live."""
        for rt in self.runtimes:
            rt.forget_prefetch()
        self.budget.prune()
        # the next forward's first groups: fetched now, while the caller prepares the next batch
        # (issued after the step, which would otherwise overwrite them)
        if not self.trace.in_pass:
            self._prefetch_ahead(-1)

    def wait_prefetches(self) -> None:
        """Block until the prefetches in flight landed (kept for the next gather): a benchmark's
        step window then holds the next forward's groups that `params_updated` prefetched."""
        for f in [rt.inflight for rt in self.runtimes if rt.inflight is not None]:
            f.result()

    def remove_hooks(self) -> None:
        self._pass.exit_modes()
        self._hooks.remove()

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters.as_dict(),
            **self.trace.stats(),
            "groups": len(self.groups),
            "persistent_groups": sum(g.persistent for g in self.groups),
            "live_numel": self.budget.live_numel(),
            "live_numel_peak": self.budget.live_peak,
            "max_live_numel": self.budget.max_live,
            "gathered_numel_peak": self.budget.gathered_peak,
            "leaf_modules": len(self._leaves),
            "collective_checks": 0 if self._order is None else self._order.checks,
        }

    def groups_of_param(self, p: nn.Parameter) -> list[int]:
        """The groups holding `p` (every piece of one in pieces)."""
        where = self._pieces.get(id(p))
        return [self.managed[id(p)][0]] if where is None else [i for i, _ in where]

    def gather_full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Consolidated copies of every parameter (on the CPU), keyed like model.state_dict()."""
        out_by_id: dict[int, torch.Tensor] = {}
        for unit in units_of(len(self.runtimes), self.splits.values()):  # a parameter's pieces at once
            for i in unit:
                self._gather(i, record=False)
            try:
                for p in (p for i in unit for p in self.runtimes[i].params):
                    out_by_id[id(p)] = p.detach().to("cpu", dtype or p.dtype, copy=True)
            finally:
                for i in reversed(unit):
                    self._release(i)
        names = self.model.named_parameters(remove_duplicate=False)
        return {n: out_by_id[id(p)] for n, p in names if id(p) in out_by_id}

    # ---- gradients: see [Note: gradient flush] in tiered/zero/group.py -------------------------
    def on_group_grads_complete(self, callback: Callable[[ShardGroup], None]) -> None:
        """Call `callback(group)` each time a group's gradients for this backward were flushed."""
        self._grad_callbacks.append(callback)

    def keep_flushed_grads(self, enabled: bool = True, keeper: GradKeeper | None = None) -> None:
        """Leave each flushed gradient homed in storage (``tiered.grad_tier: "nvme"``) in "cpu",
        dirty, for the overlapped step to consume ([Note: gradient consumed from memory] in
        tiered/optim/group.py), `keeper` admitting each such flush ([Note: backward waits instead
        of parking] in tiered/optim/kept_grads.py)."""
        for rt in self.runtimes:
            rt.keep_grads_for_step(keeper if enabled else None, enabled=enabled)

    def seal_for_step(self, group: ShardGroup) -> None:
        """The optimizer is about to update `group` while backward continues (see [Note: step
        overlapped with backward] in tiered/optim/offload.py): any later gather of it in this
        backward would see new values, so it raises instead. Unsealed when the pass ends."""
        self._pass.sealed.add(group.index)

    def finish_backward(self, *, summarize: bool = True) -> GradSummary:
        """End of backward: flush partly complete groups, release everything, end the pass, and
        (if `summarize`) return the local squared norm and overflow flag of the accumulated grads."""
        pending = [rt.has_unflushed_grads() for rt in self.runtimes]
        if self.world_size > 1:  # what any rank still holds, every rank reduces (zeros where it has none)
            pending = union_over_ranks(pending, self._order, self.process_group)
        for rt, left in zip(self.runtimes, pending, strict=True):
            if left:  # partly complete groups, and leaves whose boundary did not run
                self._flush(rt)
        self._leaves.close_all()
        for rt in self.runtimes:  # groups that got no gradient at all: now really zero
            rt.zero_pending_grad()
        self._pass.end()
        self._pass.in_backward = False
        if summarize:
            return self.grad_summary()
        return GradSummary(False, 0.0, nonfinite_group=self._probed_nonfinite_group())

    def grad_summary(self) -> GradSummary:
        """The local squared gradient norm and overflow flag ([Note: gradient norm as torch's]
        in tiered/zero/grad_norm.py)."""
        return grad_norm.local_grad_summary(self.runtimes, self.world_size, self._param_order)

    def probe_finite_grads(self) -> None:
        """From now on each gradient flush also records a sum of the gradients it adds, on their
        device and without a sync, and `finish_backward(summarize=False)` names the first group
        where one was not finite: the check of [Note: non-finite steps] in
        tiered/engine/nonfinite.py where no norm is computed anyway."""
        for rt in self.runtimes:
            if rt.group.grad is not None:
                rt.finite_probes = []

    def _probed_nonfinite_group(self) -> str | None:
        return grad_norm.probed_nonfinite_group(self.runtimes)

    def zero_grads(self) -> None:
        """Set every group's accumulated gradient to zero on its tier (lazily: see [Note: lazy
        gradient zeroing] in tiered/zero/group.py)."""
        for rt in self.runtimes:
            rt.zero_grads_lazily()

    def received_local(self, group: ShardGroup) -> torch.Tensor:
        """uint8 per entry of `group`: a gradient reached it on this rank in this accumulation window."""
        return self.runtimes[group.index].received

    def received_across_ranks(self, groups: Sequence[ShardGroup]) -> list[torch.Tensor]:
        """`received_local` of each of `groups`, OR-ed over the ranks: one all_reduce (MAX) of the
        concatenated masks. Every rank calls it once per optimizer step."""
        masks = [self.runtimes[g.index].received for g in groups]
        return masks_over_ranks(masks, self._order, self.process_group, self.world_size)

    def read_grad_shard(self, group: ShardGroup) -> torch.Tensor:
        """A CPU copy of this rank's accumulated fp32 gradient shard (tests, checkpoints)."""
        return self.runtimes[group.index].read_grad_shard()

    def _divergence(self, idxs: list[int]) -> dict[str, Any]:
        passed = [self.runtimes[i].passed_over() for i in idxs]
        return local_context(self._modules.names, self._fw_stack, self._pass.entered, passed)

    def _flush_leaf(self, mid: int) -> None:
        """A leaf's backward boundary: reduce every group it owns, in index order, on every rank."""
        leaf = self._leaves.by_module[mid]
        if leaf.open:
            leaf.open = False
            self._bw.keep.difference_update(leaf.groups)
            for i in leaf.owned:
                self._flush(self.runtimes[i])
            for i in leaf.groups:  # its frozen groups: no gradient will release them
                if self.runtimes[i].n_req_grad == 0:
                    self._bw.release(i)

    def _flush(self, rt: GroupRuntime) -> None:
        rt.flush_grads()
        self._bw.release(rt.index)
        for cb in self._grad_callbacks:
            cb(rt.group)

    # ---- gather / release: the steps around one group's own ---------------------------------
    def _gather(self, i: int, *, record: bool = True) -> None:
        rt = self.runtimes[i]
        if rt.pins > 0:
            rt.pins += 1
            return
        if i in self._pass.sealed:
            g = rt.group
            raise RuntimeError(
                f"tiered.overlap_step_with_backward: group {g.name} ({g.entries[0].name}...) was handed to the "
                "optimizer when its gradients were complete, but backward used its parameters again "
                "afterwards (a saved view of a weight whose gradient is not needed, or a use outside autograd); "
                "its values would already be the updated ones. Set tiered.overlap_step_with_backward to false "
                "for this model"
            )
        busy, self.busy = self.busy, True
        try:
            if record:
                self.trace.on_gather(i)
            if rt.evicting is not None:  # reused before its background eviction finished
                rt.wait_evicted()
            if rt.counted_live and not self.budget.is_live(i):
                self._reserve_live(rt)
            fetch = rt.start_fetch()
            if record:
                self._prefetch_ahead(i)
            rt.finish_gather(fetch)
        finally:
            self.busy = busy

    def _reserve_live(self, rt: GroupRuntime) -> None:
        """Room in the live budget for `rt`, or CapacityError. See [Note: the live budget]."""
        b, i, n = self.budget, rt.index, rt.numel
        if b.make_room(n, keep=i) or (
            self._pass.in_backward and self._bw.release_for_room(i) and b.make_room(n, keep=i)
        ):
            return
        mod = self._modules.names[id(self._fw_stack[-1])] if self._fw_stack else "<backward>"
        raise CapacityError(
            f"stage3_max_live_parameters={b.max_live}: cannot gather group {rt.group.name} "
            f"({n} elements) for module {mod!r}: {b.live_numel()} elements are "
            f"in use; raise stage3_max_live_parameters to at least {b.live_numel() + n}"
        )

    def _release(self, i: int) -> None:
        busy, self.busy = self.busy, True
        try:
            self.runtimes[i].release()
        finally:
            self.busy = busy

    def _prefetch_ahead(self, current: int) -> None:
        for j in self.trace.upcoming(self._prefetch_numel):
            rt = self.runtimes[j]
            if j == current or not rt.wants_prefetch():
                continue
            if not rt.prefetch(keep=current, beyond=self.budget.distance(j)):
                break
        self.budget.note_peaks()

    # ---- hook targets: see [Note: hooks that only dispatch] ----------------------------------
    def _groups_of(self, module: nn.Module) -> list[int]:
        mid, maps = id(module), self._modules
        if maps.params[mid] != own_param_ids(module):
            raise ShapeMutationError(
                f"module {maps.names[mid]!r} had a parameter replaced or added after tiered partitioned "
                "it: create all parameters before initialize and do not reassign them"
            )
        extra = self._extra_groups.get(mid)
        return maps.groups[mid] + extra if extra else maps.groups[mid]

    def _forward_enter(self, module: nn.Module) -> None:
        if module is self.model and not self._fw_stack:
            self._pass.begin()
        idxs = self._groups_of(module)
        self._pass.entered.add(id(module))
        for i in idxs:
            self._gather(i)
        self._fw_pins.setdefault(id(module), []).append(list(idxs))
        self._fw_stack.append(module)
        if self._pass.in_backward and torch.is_grad_enabled():  # a recomputation (checkpointing)
            self._recompute.enter()
            self._recompute_mods.append(id(module))

    def _forward_exit(self, module: nn.Module) -> None:
        if self._recompute_mods and self._recompute_mods[-1] == id(module):
            self._recompute_mods.pop()
            self._recompute.exit()
        if self._fw_stack and self._fw_stack[-1] is module:
            self._fw_stack.pop()
        stack = self._fw_pins.get(id(module))
        if stack:
            for i in stack.pop():
                self._release(i)
        if module is self.model and not self._fw_stack:
            self._pass.exit_modes()
            if not torch.is_grad_enabled():
                self._pass.end()  # no backward will follow

    def _backward_enter_cb(self, module: nn.Module) -> Callable[[], None]:
        leaf = self._leaves.by_module.get(id(module))

        def cb() -> None:
            self._pass.in_backward = True
            idxs = self._groups_of(module)
            if leaf is not None:  # held whole until its boundary: see [Note: leaf modules]
                leaf.open = True
                self._bw.keep.update(leaf.groups)
            self._bw.current = idxs
            for i in idxs:
                self._bw.gather(i)

        return cb

    def _leaf_boundary(self, module: nn.Module) -> Callable[..., tuple[torch.Tensor, ...]] | None:
        """For a leaf: wraps its inputs in `CallInBackward`, flushing it (see [Note: leaf modules]); else None."""
        mid = id(module)
        if mid not in self._leaves.by_module:
            return None
        return lambda *ts: CallInBackward.apply(lambda: self._flush_leaf(mid), *ts)

    def _gather_external(self, p: nn.Parameter) -> None:
        """A parameter used by an op while not gathered. See [Note: saved tensors and external parameters]."""
        self.counters.count_external_gather()
        mod = self._fw_stack[-1] if self._fw_stack else None
        for i in self.groups_of_param(p):
            if mod is None:  # outside any module: held until the pass ends
                self._bw.gather(i)
                continue
            extra = self._extra_groups.setdefault(id(mod), [])
            if i not in extra and i not in self._modules.groups[id(mod)]:
                extra.append(i)
            self._gather(i)
            self._fw_pins[id(mod)][-1].append(i)

    def _grad_arriving(self, p: nn.Parameter) -> Callable[[torch.Tensor], None]:
        rts = [self.runtimes[i] for i in self.groups_of_param(p)]

        def hook(grad: torch.Tensor) -> None:
            for rt in rts:
                if rt.full is None:
                    self.counters.count_backward_on_demand()
                    self._bw.gather(rt.index)

        return hook

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        for i in self.groups_of_param(p):  # (each piece's group: [Note: fused parameters in pieces])
            rt = self.runtimes[i]
            if rt.grad_arrived(p) and rt.index not in self._leaves.owner:  # a leaf's: at its boundary
                self._flush(rt)
