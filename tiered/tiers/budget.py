"""`TierBudget`: one tier's hard byte budget and the bytes reserved against it.

Written only by the `TierStateMachine` on the loop thread ([Note: reserve before move] there);
the manager reads ``budget``, ``used`` and ``peak`` for its public accessors and stats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiered.device import PAGE_SIZE, default_device
from tiered.errors import CapacityError
from tiered.storage.base import StorageBackend
from tiered.tiers.policy import EvictionPolicy, LRUPolicy
from tiered.tiers.tier import Tier
from tiered.units import format_bytes as _format_bytes


def format_bytes(n: int) -> str:
    return _format_bytes(n, binary=True)


@dataclass
class TierBudget:
    """One tier: its backend's nature, its budget (None: unbounded) and what is reserved."""

    tier: Tier
    budget: int | None
    memory_like: bool
    persistent: bool
    used: int = 0
    """Bytes reserved now: resident copies, moves in flight, home partitions."""
    peak: int = 0
    home_bytes: int = 0
    """Bytes of the partitions whose home is this tier (they never leave it)."""
    policy: EvictionPolicy | None = None
    alignment_bytes: int = 1
    """What the backend declares its buffers should be aligned to (`Capabilities`)."""
    max_concurrency: int = 0
    """Requests the backend takes at once at most; 0: no limit (`Capabilities`)."""

    @classmethod
    def of(cls, tier: Tier) -> TierBudget:
        caps = tier.backend.capabilities
        return cls(
            tier,
            tier.resolved_budget(),
            caps.memory_like,
            caps.persistent,
            policy=LRUPolicy(),
            alignment_bytes=max(1, int(caps.alignment_bytes)),
            max_concurrency=max(0, int(caps.max_concurrency)),
        )

    def aligned_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero host tensor whose first byte sits on this backend's `alignment_bytes`, for the
        bytes the manager itself hands to it (a partition created without an initial value), so
        they take the backend's direct path, not a bounce copy."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        align = self.alignment_bytes
        raw = default_device().alloc_host(nbytes + (align if align > PAGE_SIZE else 0), pin=False)
        off = (-raw.data_ptr()) % align
        return raw[off : off + nbytes].zero_().view(dtype)

    @property
    def name(self) -> str:
        return self.tier.name

    @property
    def backend(self) -> StorageBackend:
        return self.tier.backend

    def try_take(self, nbytes: int) -> bool:
        """Reserve `nbytes` if they fit now (synchronously: no other request sees the same room)."""
        if self.budget is not None and self.used + nbytes > self.budget:
            return False
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return True

    def shortfall(self, nbytes: int) -> int:
        """Bytes to free before `nbytes` fit."""
        return 0 if self.budget is None else max(0, self.used + nbytes - self.budget)

    def give_back(self, nbytes: int) -> None:
        self.used -= nbytes
        assert self.used >= 0, f"tier {self.name}: negative usage"

    def never_fits(self, nbytes: int, part_name: str, op: str) -> CapacityError | None:
        """The error for a request bigger than the budget minus the home partitions, else None."""
        if self.budget is None or nbytes <= self.budget - self.home_bytes:
            return None
        return CapacityError(
            f"{op} of partition {part_name!r} ({format_bytes(nbytes)}) can never fit tier {self.name!r}: "
            f"budget {format_bytes(self.budget)}, of which {format_bytes(self.home_bytes)} is held by partitions "
            f"whose home is {self.name!r}; raise the tier's budget, move some partitions' home to a "
            "slower tier, or split the partition smaller"
        )

    def no_room(self, op: str, part_name: str, nbytes: int, pinned: int, timeout_s: float) -> str:
        """What a request that waited out its timeout for room reports."""
        return (
            f"{op} of partition {part_name!r} ({format_bytes(nbytes)}) waited {timeout_s} s for room in "
            f"tier {self.name!r}: budget {format_bytes(self.budget or 0)}, in use {format_bytes(self.used)} "
            f"({format_bytes(pinned)} pinned by fetch/allocate, {format_bytes(self.home_bytes)} home); "
            "release() pinned partitions, or raise the tier's budget"
        )
