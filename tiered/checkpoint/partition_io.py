"""Reading and writing one partition's bytes through the TierManager, for checkpoints.

[Note: checkpoint partition I/O]
A save reads each partition where its newest bytes already are when that is a memory-like tier
(a host tier first: no device copy), else it fetches it into the "cpu" tier, streams it out in
chunks and evicts the copy again (a clean copy: free), so at most one partition per save is
resident beyond what training holds. A copy on a CUDA device is copied to the host one bounded
chunk at a time. A load writes a partition at its home when the home is memory-like (the copy
the ZeRO-3 home views alias, see [Note: home views]), else allocates it in "cpu", fills it and
evicts it, which writes it home; either way `mark_dirty` / `allocate` make every other copy
(a gathered or prefetched one on the GPU) stale, so nothing old is read afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_STAGING_TIER = "cpu"


def _memory_like(tm: Any, tier: str) -> bool:
    return bool(tm.tier(tier).backend.capabilities.memory_like)


def _host_device(tm: Any, tier: str) -> bool:
    return str(tm.tier(tier).backend.capabilities.device) == "cpu"


def read_tier(tm: Any, part: Any) -> str:
    """The memory-like tier a save reads `part` from. See [Note: checkpoint partition I/O]."""
    valid = [t for t in part.valid_in() if _memory_like(tm, t)]
    valid.sort(key=lambda t: (not _host_device(tm, t), t != part.home))
    return valid[0] if valid else _STAGING_TIER


@contextmanager
def resident(tm: Any, part: Any) -> Iterator[torch.Tensor]:
    """`part`'s newest bytes as a (pinned) resident tensor, released (and evicted where this
    fetched it) on exit. See [Note: checkpoint partition I/O]."""
    tier = read_tier(tm, part)
    was_resident = part.state(tier).resident
    t = tm.fetch(part, tier).result()
    try:
        yield t
    finally:
        tm.release(part, tier)
        if not was_resident and tier != part.home:
            tm.evict(part, tier).result()


def write_partition(tm: Any, part: Any, src: torch.Tensor) -> None:
    """Replace every byte of `part` with host tensor `src` (same dtype and numel)."""
    if src.dtype != part.dtype or src.numel() != part.numel:
        raise ValueError(
            f"partition {part.name!r}: checkpoint data has {src.numel()} elements of {src.dtype}, "
            f"expected {part.numel} of {part.dtype}"
        )
    if _memory_like(tm, part.home):
        t = tm.fetch(part, part.home).result()
        try:
            t.copy_(src.reshape(-1))
            tm.mark_dirty(part, part.home)  # other copies (a gathered one) are stale now
        finally:
            tm.release(part, part.home)
        return
    t = tm.allocate(part, _STAGING_TIER).result()
    try:
        t.copy_(src.reshape(-1))
    finally:
        tm.release(part, _STAGING_TIER)
    tm.evict(part, _STAGING_TIER).result()  # dirty: written home
