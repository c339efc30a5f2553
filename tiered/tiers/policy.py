"""Eviction policies: which unpinned copies leave a tier first when a request needs room.

A policy only orders candidates; the manager decides how many to evict (enough to cover
``need_bytes``), skips anything the policy returns that is not a candidate, and does the moves.
The ZeRO-3 schedule plugs in its own policy (Belady's rule over the recorded trace) through
`TierManager.set_eviction_policy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from tiered.tiers.partition import CopyState, Partition


@runtime_checkable
class EvictionPolicy(Protocol):
    def choose(self, tier: str, candidates: Sequence[Partition], need_bytes: int) -> Sequence[Partition]:
        """Candidates in the order they should be evicted from `tier` to free `need_bytes`."""
        ...


class LRUPolicy:
    """Least recently used first (use = fetch, prefetch, allocate or release in that tier)."""

    def choose(self, tier: str, candidates: Sequence[Partition], need_bytes: int) -> Sequence[Partition]:
        return sorted(candidates, key=lambda p: p.last_use(tier))


class CleanFirstLRUPolicy:
    """Least recently used first, but clean copies (free to drop) before dirty ones (a write)."""

    def choose(self, tier: str, candidates: Sequence[Partition], need_bytes: int) -> Sequence[Partition]:
        return sorted(
            candidates,
            key=lambda p: (p.state(tier) is CopyState.DIRTY, p.last_use(tier)),
        )
