"""What the parameter schedule may hold in the "gpu" tier: the live budget while running, and the
whole-model check against it and the gpu tier's budget before any partition is written.

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
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tiered.errors import CapacityError, ConfigError


class LiveMember(Protocol):
    """What the budget needs of a group it counts (a `tiered.zero.group.GroupRuntime`)."""

    @property
    def pins(self) -> int: ...

    def settle_live(self) -> None: ...

    def evict(self, *, wait: bool = True) -> None: ...


class LiveBudget:
    """The live set of non-persistent groups in "gpu", bounded by ``max_live`` elements; the
    gathered set; their peaks. See [Note: the live budget]."""

    def __init__(self, max_live: int, numel_of: Sequence[int], next_use: Callable[[int], int | None]) -> None:
        self.max_live = max_live
        self._numel = list(numel_of)
        self._next_use = next_use  # elements until a group's next use in this pass (None: not again)
        self._members: Sequence[LiveMember] = ()
        self.live: dict[int, int] = {}
        """group index -> elements it holds in "gpu" (gathered, prefetched or kept for reuse)."""
        self.gathered: dict[int, None] = {}
        """Insertion-ordered set of the groups gathered now (pins > 0)."""
        self.live_peak = 0
        self.gathered_peak = 0

    def bind(self, members: Sequence[LiveMember]) -> None:
        """The groups, by index (they are built after the budget, which they hold)."""
        self._members = members

    def distance(self, i: int) -> float:
        """Elements gathered before group `i` is used again in this pass; inf if not again."""
        d = self._next_use(i)
        return float("inf") if d is None else float(d)

    def live_numel(self) -> int:
        return sum(self.live.values())

    def is_live(self, i: int) -> bool:
        return i in self.live

    def add(self, i: int) -> None:
        self.live[i] = self._numel[i]

    def discard(self, i: int) -> None:
        self.live.pop(i, None)

    def note_peaks(self) -> None:
        self.live_peak = max(self.live_peak, sum(self.live.values()))
        self.gathered_peak = max(self.gathered_peak, sum(self._numel[i] for i in self.gathered))

    def prune(self) -> None:
        """Forget groups that left "gpu" on their own (a finished background eviction, or the
        manager's eviction under budget pressure)."""
        for i in list(self.live):
            self._members[i].settle_live()

    def make_room(self, need: int, keep: int, *, beyond: float = -1.0) -> bool:
        """Evict released live groups (furthest next use first) until `need` more fits; only
        groups whose next use is further than `beyond` elements away (a prefetch must not evict
        what is needed before the group it prefetches)."""
        self.prune()
        total = sum(self.live.values())
        if total + need <= self.max_live:
            return True
        victims = [
            i for i in self.live if i != keep and self._members[i].pins == 0 and self.distance(i) > beyond
        ]
        for i in sorted(victims, key=self.distance, reverse=True):
            self._members[i].evict()
            total = sum(self.live.values())
            if total + need <= self.max_live:
                return True
        return False


UNCHECKED_MAX_LIVE = (1_000_000_000, sys.maxsize)
"""``stage3_max_live_parameters`` values left to eviction under pressure rather than counted as a
need: DeepSpeed's default, and 0 read as no cap ([Note: the live budget searched] in
tiered/planning/search.py)."""


@dataclass(frozen=True)
class PlannedSize:
    """One planned group's sizes, before its partitions exist."""

    numel: int
    full_numel: int
    persistent: bool


@dataclass(frozen=True)
class GpuGatherNeed:
    """Bytes the parameter schedule holds in the "gpu" tier at its peak. The engine's capacity
    check (tiered/engine/build.py) takes the gather and persistent terms from here."""

    home_bytes: int
    """Parameter and gradient shards homed in "gpu"."""
    persistent_bytes: int
    """Persistent groups, gathered for the whole run (0 when parameters are homed in "gpu" on one rank)."""
    gather_bytes: int
    """The largest module's non-persistent groups gathered at once."""
    largest_module: str

    @property
    def total_bytes(self) -> int:
        return self.home_bytes + self.persistent_bytes + self.gather_bytes


def check_gather_budgets(
    sizes: Sequence[PlannedSize],
    module_groups: Sequence[tuple[str, Sequence[int]]],
    *,
    max_live: int,
    gpu_budget_bytes: int | None,
    param_itemsize: int,
    world_size: int,
    param_tier: str,
    grad_homes: Sequence[str | None],
    needs_fetch: bool,
    joint_numel: Sequence[int] = (),
) -> GpuGatherNeed:
    """Fail before training if a module can never be gathered within stage3_max_live_parameters
    or the gpu tier's budget; `module_groups` is (module name, its group indices) in module
    order, `joint_numel` per module the elements of the whole buffers its parameters in pieces
    are put together in ([Note: fused parameters in pieces] in tiered/zero/split.py). Returns
    the gpu bytes needed. See [Note: the live budget]."""
    worst, worst_mod, largest_full, largest_mod = 0, "", 0, ""
    largest_joint, best = 0, (-1.0, 0)
    per_full = (1 + 1 / world_size) if world_size > 1 else 1  # a gathered full buffer plus its shard
    joints = list(joint_numel) or [0] * len(module_groups)
    for (mname, idxs), joint in zip(module_groups, joints, strict=True):
        n = sum(sizes[i].numel for i in idxs if not sizes[i].persistent) if needs_fetch else 0
        if n > worst:
            worst, worst_mod = n, mname
        full = sum(sizes[i].full_numel for i in idxs if not sizes[i].persistent)
        key = ((full * per_full if needs_fetch else 0.0) + joint, full)
        if key > best:
            best, largest_full, largest_mod, largest_joint = key, full, mname, joint
    if worst > max_live:
        raise ConfigError(
            f"zero_optimization.stage3_max_live_parameters={max_live} is too small: module "
            f"{worst_mod!r} needs {worst} parameter elements gathered at once; set it to at least {worst}"
        )
    elt, ws = param_itemsize, world_size
    home = sum(s.full_numel // ws for s in sizes) * elt if param_tier == "gpu" else 0
    home += sum(s.full_numel // ws for s, h in zip(sizes, grad_homes, strict=True) if h == "gpu") * 4
    persistent = largest = 0
    if needs_fetch:
        persistent = int(sum(s.full_numel for s in sizes if s.persistent) * elt * per_full)
        largest = int(largest_full * elt * per_full)
    largest += largest_joint * elt
    need = GpuGatherNeed(home, persistent, largest, largest_mod)
    if gpu_budget_bytes is not None and need.total_bytes > gpu_budget_bytes:
        raise CapacityError(
            f"gpu tier budget {gpu_budget_bytes} bytes is too small: the largest module needs {largest} bytes "
            f"gathered, on top of {persistent} bytes of persistent parameters and {home} bytes of "
            f"partitions homed in the gpu tier: at least {need.total_bytes} bytes in all; raise the gpu tier's "
            "budget (tiered.tiers.gpu), offload parameters/gradients, or lower "
            "stage3_param_persistence_threshold"
        )
    return need
