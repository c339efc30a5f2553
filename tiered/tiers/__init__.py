"""The tier layer: partitions moved between GPU, pinned CPU and NVMe tiers under hard budgets.

``TierManager`` owns one asyncio loop in one daemon thread; training code gets ``TierFuture``s.
The facade (`manager`) hands every operation to the one state machine (`state_machine`), which
writes partitions (`partition`) and budgets (`budget`) and lets `transfer` move the bytes; see the
Notes in `loop`, `state_machine`, `partition`, `waiting` and `error_context`.
"""

from __future__ import annotations

from tiered.tiers.future import TierFuture
from tiered.tiers.io_policy import DEFAULT_TRANSIENT, IOPolicy
from tiered.tiers.loop import EventLoopThread, ManagerClosedError
from tiered.tiers.manager import TierManager
from tiered.tiers.partition import CopyState, Partition, PinnedError
from tiered.tiers.policy import CleanFirstLRUPolicy, EvictionPolicy, LRUPolicy
from tiered.tiers.tier import Tier

__all__ = [
    "CleanFirstLRUPolicy",
    "CopyState",
    "EventLoopThread",
    "DEFAULT_TRANSIENT",
    "EvictionPolicy",
    "IOPolicy",
    "LRUPolicy",
    "ManagerClosedError",
    "Partition",
    "PinnedError",
    "Tier",
    "TierFuture",
    "TierManager",
]
