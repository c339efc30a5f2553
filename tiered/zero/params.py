"""ZeroParameters: the owner of every partitioned parameter of one model.

Builds the flat shard groups (see [Note: flat shard groups]), owns their partitions in the
TierManager, installs the hooks (see [Note: hooks that only dispatch]) and runs the gather /
release / prefetch / evict schedule (see [Note: trace and re-synchronisation]) and the gradient
path (tiered/zero/grads.py).

[Note: the live budget]
``stage3_max_live_parameters`` bounds the elements of non-persistent groups that sit in the
"gpu" tier beyond their home copy: gathered (in use), prefetched (in flight or waiting) and kept
for reuse. It is hard and includes the current fetch: before a fetch or a prefetch would cross
it, released groups are evicted (furthest next use first); a prefetch that still does not fit
is not issued; a fetch that cannot fit because everything live is in use raises CapacityError
naming the module and the value needed. Groups whose home is the "gpu" tier on one rank cost
nothing to gather (the home copy is the gathered buffer) and are not counted; persistent groups
are not counted either (DeepSpeed's rule). The whole-model check at init (largest module need
> budget) turns most such errors into one clear message before training starts.

[Note: home views]
A partition's home copy never leaves its home tier (the manager only drops it with the
partition). Where that home is memory-like (parameters homed in "gpu" on one rank; gradients,
always homed in "gpu" or "cpu"), the resident home tensor is therefore stable, and going
through the manager's loop thread for every gather, release and gradient add would cost a
cross-thread round trip each, for no movement at all. ZeroParameters takes each such tensor
once (fetch, release) and uses it directly; it still calls ``mark_dirty`` whenever another tier
holds a copy (which the write makes stale), so the manager's view stays exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tiered.errors import CapacityError, ConfigError, ShapeMutationError
from tiered.zero import comm
from tiered.zero.dispatch import DispatchMixin
from tiered.zero.grads import GradMixin, GradSummary
from tiered.zero.groups import ParamEntry, ShardGroup, group_name, padded_numel
from tiered.zero.hooks import HookSet
from tiered.zero.meta import materialize_buffers, materialize_group
from tiered.zero.plan import check_no_meta_mix, flat_fp32, plan_groups
from tiered.zero.schedule import BeladyPolicy, Trace

if TYPE_CHECKING:
    from tiered.config.schema import TieredConfig
    from tiered.tiers import TierManager

log = logging.getLogger(__name__)

ALIGNMENT_NUMEL = 64
"""Shards start at multiples of 64 elements (128 B in bf16, 256 B in fp32)."""

__all__ = ["ZeroParameters", "GradSummary", "ALIGNMENT_NUMEL"]


class _GroupState:
    """Mutable per-group bookkeeping, private to ZeroParameters."""

    __slots__ = ("pins", "full", "inflight", "evicting", "grads_seen", "n_req_grad", "params", "needs_fetch",
                 "full_part")

    def __init__(self, params: list[nn.Parameter], needs_fetch: bool) -> None:
        self.pins = 0
        self.full: torch.Tensor | None = None
        self.inflight: Any = None  # TierFuture of a prefetch not yet consumed
        self.evicting: Any = None  # TierFuture of an eviction issued at release, not yet awaited
        self.grads_seen: set[int] = set()
        self.n_req_grad = sum(1 for p in params if p.requires_grad)
        self.params = params
        self.needs_fetch = needs_fetch
        self.full_part: Any = None  # world_size > 1: the gathered full buffer's partition


class ZeroParameters(DispatchMixin, GradMixin):
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
        process_group: object | None = None,
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
        for t in (param_tier, grad_tier, "gpu"):
            if t not in tm.tier_names:
                raise ConfigError(f"tier {t!r} is not configured (tiers: {tm.tier_names}); add it under tiered.tiers")
        self.device = torch.device(tm.tier("gpu").backend.capabilities.device)
        if self.device.type == "cuda" and self.device.index is None:  # compare equal to tensors' devices
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._prefetch_numel = z.prefetch_bucket_size_numel
        self._max_live = z.max_live_parameters_numel
        self._max_reuse = z.max_reuse_distance_numel
        self._busy = False
        self._placeholder = torch.empty(0, dtype=compute_dtype, device=self.device)
        self._counters = dict.fromkeys(
            ("fetches", "prefetch_hits", "cache_hits", "misses", "prefetches", "evictions", "external_gathers",
             "backward_on_demand", "grad_flushes", "saved_refs"), 0)
        self._live: dict[int, int] = {}
        self._home_views: dict[str, torch.Tensor] = {}
        self._gathered: dict[int, None] = {}  # insertion-ordered set of groups with pins > 0
        self._live_peak = 0
        self._gathered_peak = 0

        is_meta = check_no_meta_mix(model)
        # A block is one group only while two of them (the current and the prefetched next) fit
        # the live budget and a quarter of the gpu tier: see [Note: group planning].
        block_cap = min(z.sub_group_size_numel, z.max_live_parameters_numel // 2)
        gpu_budget = tm.budget_bytes("gpu")
        if gpu_budget is not None:
            itemsize = torch.empty(0, dtype=compute_dtype).element_size()
            block_cap = min(block_cap, gpu_budget // (4 * itemsize) * self.world_size)
        planned = plan_groups(
            model,
            sub_group_size_numel=z.sub_group_size_numel,
            param_persistence_threshold_numel=z.param_persistence_threshold_numel,
            model_persistence_threshold_numel=z.model_persistence_threshold_numel,
            max_block_numel=block_cap,
        )
        self.groups: list[ShardGroup] = []
        self._st: list[_GroupState] = []
        self._init_fp32: dict[int, torch.Tensor] = {}
        self._init_taken: set[int] = set()
        self._part_group: dict[str, int] = {}
        ws, rank = self.world_size, self.rank
        self._needs_fetch = ws > 1 or param_tier != "gpu"
        self._managed: dict[int, tuple[int, int]] = {  # id(param) -> (group index, entry index)
            id(p): (i, j) for i, pg in enumerate(planned) for j, (_, p) in enumerate(pg.params)
        }
        self._module_groups: dict[int, list[int]] = {}
        self._module_names: dict[int, str] = {}
        self._module_params: dict[int, tuple[int, ...]] = {}
        for mname, m in model.named_modules():
            idxs = sorted({self._managed[id(p)][0] for p in m.parameters(recurse=False) if id(p) in self._managed})
            self._module_groups[id(m)] = idxs
            self._module_names[id(m)] = mname or type(m).__name__
            self._module_params[id(m)] = tuple(id(p) for p in m.parameters(recurse=False))
        self._extra_groups: dict[int, list[int]] = {}  # module -> groups it used from elsewhere
        sizes = [(pg.numel, padded_numel(pg.numel, ws, ALIGNMENT_NUMEL), pg.persistent) for pg in planned]
        self._check_budgets(sizes)  # before any partition is written: fail fast
        for i, pg in enumerate(planned):
            name = group_name(i)
            entries, off = [], 0
            for qual, p in pg.params:
                entries.append(ParamEntry(qual, off, p.numel(), tuple(p.shape)))
                off += p.numel()
            full = padded_numel(off, ws, ALIGNMENT_NUMEL)
            shard = full // ws
            if is_meta:
                materialize_group(model, pg.params, torch.device("cpu"))
            flat = flat_fp32(pg.params, full)
            shard32 = flat[rank * shard : (rank + 1) * shard]
            ppart = tm.create(f"{name}.param", shard, compute_dtype, param_tier, init=shard32.to(compute_dtype))
            gpart = tm.create(f"{name}.grad", shard, torch.float32, grad_tier) if pg.trainable else None
            if pg.trainable and (compute_dtype != torch.float32 or is_meta):
                self._init_fp32[i] = shard32.clone()
            del flat, shard32
            g = ShardGroup(i, name, tuple(entries), full, shard, rank * shard, ppart, gpart, pg.persistent)
            params = [p for _, p in pg.params]
            self.groups.append(g)
            self._st.append(_GroupState(params, needs_fetch=self._needs_fetch))
            self._part_group[ppart.name] = i
            for p in params:
                p.data = self._placeholder
        self._params_by_id = {id(p): p for st in self._st for p in st.params}
        if is_meta:
            materialize_buffers(model, self.device)
        for b_mod in model.modules():  # buffers (rotary tables, masks) live where compute runs
            for bname, buf in list(b_mod._buffers.items()):
                if buf is not None and buf.device != self.device:
                    b_mod._buffers[bname] = buf.to(self.device)


        self.trace = Trace([g.numel for g in self.groups])
        tm.set_eviction_policy("gpu", BeladyPolicy(self._part_group.get, self.trace, lambda i: self.groups[i].persistent))
        self._fw_stack: list[nn.Module] = []
        self._fw_pins: dict[int, list[list[int]]] = {}
        self._bw_held: set[int] = set()
        self._bw_frozen: list[int] = []
        self._bw_current: list[int] = []
        self._in_backward = False
        self._modes: list[Any] = []
        self._grad_callbacks: list[Callable[[ShardGroup], None]] = []
        self._sealed: set[int] = set()  # groups being stepped during this backward
        # groups whose gradient partition is logically zero: see [Note: lazy gradient zeroing]
        self._grad_zero_pending: set[int] = {g.index for g in self.groups if g.grad is not None}
        self._hooks = HookSet(self, model, [p for st in self._st for p in st.params])
        log.info("partitioned %d parameters into %d groups (%d persistent), world_size=%d",
                 sum(g.numel for g in self.groups), len(self.groups), sum(g.persistent for g in self.groups), ws)

    def _home_view(self, part: Any) -> torch.Tensor:
        """The stable resident home tensor of `part`. See [Note: home views]."""
        t = self._home_views.get(part.name)
        if t is None:
            t = self.tm.fetch(part, part.home).result()
            self.tm.release(part, part.home)
            self._home_views[part.name] = t
        return t

    def _home_written(self, part: Any) -> None:
        """The home copy was modified in place: tell the manager if another copy went stale."""
        if part.valid_in() != frozenset((part.home,)):
            self.tm.mark_dirty(part, part.home)

    # ---- public ------------------------------------------------------------------------------
    def initial_fp32_shard(self, group: ShardGroup) -> torch.Tensor:
        """fp32 master values of this rank's shard of `group`, as partitioned. Once per group."""
        i = group.index
        if i in self._init_taken:
            raise RuntimeError(f"initial_fp32_shard({group.name}) was already taken (it is freed after one call)")
        self._init_taken.add(i)
        if i in self._init_fp32:
            return self._init_fp32.pop(i)
        was_resident = group.param.state("gpu").resident
        t = self.tm.fetch(group.param, "gpu").result()
        try:
            return t.detach().to("cpu", torch.float32, copy=True)
        finally:
            self.tm.release(group.param, "gpu")
            if not was_resident and group.param.home != "gpu":  # not counted live: do not leave it
                self.tm.evict(group.param, "gpu").result()

    def params_updated(self) -> None:
        """The optimizer wrote new parameter values (through the manager, which invalidated stale
        copies): forget prefetches issued before, and recount what is still live."""
        for st in self._st:
            if st.inflight is not None:
                st.inflight.result()
                st.inflight = None
        self._prune_live()
        # the next forward's first groups: fetched now, while the caller prepares the next batch
        # (issued after the step, which would otherwise overwrite them)
        if not self.trace.in_pass:
            self._prefetch_ahead(-1)

    def remove_hooks(self) -> None:
        self._exit_modes()
        self._hooks.remove()

    def stats(self) -> dict[str, Any]:
        return {
            **self._counters,
            **self.trace.stats(),
            "groups": len(self.groups),
            "persistent_groups": sum(g.persistent for g in self.groups),
            "live_numel": sum(self._live.values()),
            "live_numel_peak": self._live_peak,
            "max_live_numel": self._max_live,
            "gathered_numel_peak": self._gathered_peak,
        }

    def gather_full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Consolidated copies of every parameter (on the CPU), keyed like model.state_dict()."""
        out_by_id: dict[int, torch.Tensor] = {}
        for g in self.groups:
            self._gather(g.index, record=False)
            try:
                for p in self._st[g.index].params:
                    out_by_id[id(p)] = p.detach().to("cpu", dtype or p.dtype, copy=True)
            finally:
                self._release(g.index)
        return {n: out_by_id[id(p)] for n, p in self.model.named_parameters(remove_duplicate=False)
                if id(p) in out_by_id}

    def iter_full_groups(self) -> Iterator[tuple[ShardGroup, list[tuple[str, torch.Tensor]]]]:
        """For exports (tiered/checkpoint/export.py): each group gathered in turn (a collective
        with several ranks), its parameters as (name, full tensor) views into the gathered
        buffer, valid until the next iteration, then released, and evicted again unless it was
        resident before (the reuse cache would otherwise keep every group). Never more than one."""
        for g in self.groups:
            was_resident = g.param.state("gpu").resident
            self._gather(g.index, record=False)
            try:
                yield g, [(e.name, p.detach()) for e, p in zip(g.entries, self._st[g.index].params, strict=True)]
            finally:
                self._release(g.index)
                if self._st[g.index].needs_fetch and not g.persistent and not was_resident:
                    self._evict(g.index)

    @contextmanager
    def gathered(self, params: Iterable[nn.Parameter]) -> Iterator[list[tuple[ShardGroup, torch.Tensor]]]:
        """For engine.gathered_parameters: the groups holding `params` gathered (their ``.data``
        the full values) until exit; yields (group, full flat buffer) per group."""
        idxs, unknown = set(), []
        for p in params:
            if id(p) in self._managed:
                idxs.add(self._managed[id(p)][0])
            else:
                unknown.append(tuple(p.shape))
        if unknown:
            raise ValueError(f"gathered_parameters: {len(unknown)} tensors (shapes {unknown[:3]}) are not parameters "
                             "this engine manages")
        done: list[int] = []
        try:
            for i in sorted(idxs):
                self._gather(i, record=False)
                done.append(i)
            yield [(self.groups[i], self._st[i].full) for i in done]
        finally:
            for i in reversed(done):
                self._release(i)

    # ---- budgets -----------------------------------------------------------------------------
    def _check_budgets(self, sizes: list[tuple[int, int, bool]]) -> None:
        """Fail before training if a module can never be gathered within stage3_max_live_parameters
        or the gpu tier's budget; `sizes` is (numel, full_numel, persistent) per planned group.
        See [Note: the live budget]."""
        worst, worst_mod, largest_full = 0, "", 0
        for mid, idxs in self._module_groups.items():
            n = sum(sizes[i][0] for i in idxs if not sizes[i][2]) if self._needs_fetch else 0
            if n > worst:
                worst, worst_mod = n, self._module_names[mid]
            largest_full = max(largest_full, sum(sizes[i][1] for i in idxs if not sizes[i][2]))
        if worst > self._max_live:
            raise ConfigError(
                f"zero_optimization.stage3_max_live_parameters={self._max_live} is too small: module "
                f"{worst_mod!r} needs {worst} parameter elements gathered at once; set it to at least {worst}"
            )
        budget = self.tm.tier("gpu").budget_bytes
        if budget is None:
            return
        elt, ws = self._placeholder.element_size(), self.world_size
        home = sum(full // ws for _, full, _ in sizes) * elt if self.param_tier == "gpu" else 0
        home += sum(full // ws for _, full, _ in sizes) * 4 if self.grad_tier == "gpu" else 0
        persistent = largest = 0
        if self._needs_fetch:
            per_full = (1 + 1 / ws) if ws > 1 else 1  # a gathered full buffer plus its shard
            persistent = int(sum(full for _, full, p in sizes if p) * elt * per_full)
            largest = int(largest_full * elt * per_full)
        need = home + persistent + largest
        if need > budget:
            raise CapacityError(
                f"gpu tier budget {budget} bytes is too small: the largest module needs {largest} bytes "
                f"gathered, on top of {persistent} bytes of persistent parameters and {home} bytes of "
                f"partitions homed in the gpu tier: at least {need} bytes in all; raise the gpu tier's "
                "budget (tiered.tiers.gpu), offload parameters/gradients, or lower "
                "stage3_param_persistence_threshold"
            )

    def _note_live(self) -> None:
        n = sum(self._live.values())
        self._live_peak = max(self._live_peak, n)
        g = sum(self.groups[i].numel for i in self._gathered)
        self._gathered_peak = max(self._gathered_peak, g)

    def _prune_live(self) -> None:
        for i in list(self._live):
            st = self._st[i]
            if st.evicting is not None and st.evicting.done():
                self._wait_evicted(i)  # raises here if the background eviction failed
            # state().resident includes a copy still loading (a fetch in flight) or being evicted
            elif st.pins == 0 and st.inflight is None and not self.groups[i].param.state("gpu").resident:
                del self._live[i]  # the manager evicted it under budget pressure

    def _evict(self, i: int, *, wait: bool = True) -> None:
        """Evict group i's copy from "gpu". With wait=False (at release) the eviction runs in the
        background; the group stays counted live until it completed (see _prune_live)."""
        st = self._st[i]
        if st.inflight is not None:
            st.inflight.result()
            st.inflight = None
        if st.evicting is None and self.groups[i].param.is_resident("gpu"):
            st.evicting = self.tm.evict(self.groups[i].param, "gpu")
            self._counters["evictions"] += 1
        if wait:
            self._wait_evicted(i)

    def _wait_evicted(self, i: int) -> None:
        st = self._st[i]
        if st.evicting is not None:
            fut, st.evicting = st.evicting, None
            fut.result()
        self._live.pop(i, None)

    def _make_room(self, need: int, keep: int, *, beyond: float = -1.0) -> bool:
        """Evict released live groups (furthest next use first) until `need` more fits; only
        groups whose next use is further than `beyond` elements away (a prefetch must not evict
        what is needed before the group it prefetches)."""
        self._prune_live()
        total = sum(self._live.values())
        if total + need <= self._max_live:
            return True
        victims = [i for i in self._live if i != keep and self._st[i].pins == 0 and self._dist(i) > beyond]
        for i in sorted(victims, key=self._dist, reverse=True):
            self._evict(i)
            total = sum(self._live.values())
            if total + need <= self._max_live:
                return True
        return False

    def _dist(self, i: int) -> float:
        d = self.trace.next_use_distance(i)
        return float("inf") if d is None else float(d)

    # ---- gather / release ---------------------------------------------------------------------
    def _gather(self, i: int, *, record: bool = True) -> None:
        st = self._st[i]
        if st.pins > 0:
            st.pins += 1
            return
        g = self.groups[i]
        if i in self._sealed:
            raise RuntimeError(
                f"tiered.overlap_step_with_backward: group {g.name} ({g.entries[0].name}...) was handed to the "
                "optimizer when its gradients were complete, but backward used its parameters again "
                "afterwards (a saved view of a weight whose gradient is not needed, or a use outside autograd); "
                "its values would already be the updated ones. Set tiered.overlap_step_with_backward to false "
                "for this model"
            )
        busy, self._busy = self._busy, True
        try:
            if record:
                self.trace.on_gather(i)
            if st.evicting is not None:  # reused before its background eviction finished
                self._wait_evicted(i)
            counted = st.needs_fetch and not g.persistent
            if counted and i not in self._live:
                if not self._make_room(g.numel, keep=i) and not (
                    self._in_backward and self._release_bw_for_room(i) and self._make_room(g.numel, keep=i)
                ):
                    mod = self._module_names[id(self._fw_stack[-1])] if self._fw_stack else "<backward>"
                    raise CapacityError(
                        f"stage3_max_live_parameters={self._max_live}: cannot gather group {g.name} "
                        f"({g.numel} elements) for module {mod!r}: {sum(self._live.values())} elements are "
                        f"in use; raise stage3_max_live_parameters to at least "
                        f"{sum(self._live.values()) + g.numel}"
                    )
            if st.needs_fetch:
                self._counters["fetches"] += 1
                if st.inflight is not None:
                    self._counters["prefetch_hits"] += 1
                elif g.param.is_resident("gpu"):
                    self._counters["cache_hits"] += 1
                else:
                    self._counters["misses"] += 1
            if st.needs_fetch:
                fut = self.tm.fetch(g.param, "gpu")
                st.inflight = fut  # the manager may not have started it yet: not "absent" for _prune_live
                if counted:
                    self._live[i] = g.numel
                if record:
                    self._prefetch_ahead(i)
                shard = fut.result()
                st.inflight = None
            else:  # homed in "gpu" on one rank: the home copy is the gathered buffer
                if not g.param.is_resident(g.param.home):  # newer bytes elsewhere: bring them home
                    self.tm.flush(g.param).result()
                shard = self._home_view(g.param)
                if record:
                    self._prefetch_ahead(i)
            full = self._assemble_full(i, shard)
            with torch.no_grad():
                for e, p in zip(g.entries, st.params, strict=True):
                    if p.data.numel() != 0 or p.dtype != self.compute_dtype:
                        raise ShapeMutationError(
                            f"parameter {e.name!r} was replaced outside tiered (now shape {tuple(p.shape)}, "
                            f"dtype {p.dtype}; tiered manages it as shape {e.shape}): do not assign .data of "
                            "parameters of a tiered model; build the model with its final shapes before initialize"
                        )
                    p.data = full[e.offset : e.offset + e.numel].view(e.shape)
            st.full = full
            st.pins = 1
            self._gathered[i] = None
            self._note_live()
        finally:
            self._busy = busy

    def _assemble_full(self, i: int, shard: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return shard
        g, st = self.groups[i], self._st[i]
        if st.full_part is None:
            home = "cpu" if "cpu" in self.tm.tier_names else self.param_tier
            st.full_part = self.tm.create(f"{g.name}.full", g.full_numel, self.compute_dtype, home)
        full = self.tm.allocate(st.full_part, "gpu").result()
        comm.all_gather_into(full, shard, self.process_group)
        return full

    def _release(self, i: int) -> None:
        st = self._st[i]
        if st.pins <= 0:
            raise AssertionError(f"group {self.groups[i].name} released more often than gathered")
        st.pins -= 1
        if st.pins:
            return
        g = self.groups[i]
        busy, self._busy = self._busy, True
        try:
            with torch.no_grad():
                for e, p in zip(g.entries, st.params, strict=True):
                    if tuple(p.shape) != e.shape:
                        raise ShapeMutationError(
                            f"parameter {e.name!r} changed shape from {e.shape} to {tuple(p.shape)} while in use: "
                            "tiered partitions parameters with fixed shapes; do not reassign .data or resize them"
                        )
                    p.data = self._placeholder
            st.full = None
            self._gathered.pop(i, None)
            if st.needs_fetch:
                self.tm.release(g.param, "gpu")
            if st.full_part is not None:
                self.tm.release(st.full_part, "gpu")
                self.tm.evict(st.full_part, "gpu").result()
            if st.needs_fetch and not g.persistent:
                d = self.trace.next_use_distance(i)
                if d is None or d > self._max_reuse:
                    self._evict(i, wait=False)
        finally:
            self._busy = busy

    def _prefetch_ahead(self, current: int) -> None:
        for j in self.trace.upcoming(self._prefetch_numel):
            st, g = self._st[j], self.groups[j]
            if j == current or not st.needs_fetch or st.pins > 0 or st.inflight is not None:
                continue
            if g.param.is_resident("gpu"):
                continue
            if not g.persistent:
                if j not in self._live and not self._make_room(g.numel, keep=current, beyond=self._dist(j)):
                    break
                self._live[j] = g.numel
            st.inflight = self.tm.prefetch(g.param, "gpu")
            self._counters["prefetches"] += 1
        self._note_live()
