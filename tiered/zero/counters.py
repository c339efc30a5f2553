"""The schedule counters of one model's ZeRO-3 run (``engine.stats()["zero"]``), and their one writer.

[Note: one writer of the schedule counters]
The counts are written only here, each by a method named for the event it counts
(`count_fetch`, `count_eviction`, ...). They used to be a plain dict that the coordinator, the
group runtime and the saved-tensor hooks each incremented by key, one count (backward_on_demand)
from two files, so what a number meant was spread over three modules and a misspelt key made a new,
silent count. Now a reader looks up an event in one place, and the others can only read:
`ScheduleCounters` has no item assignment, and tests/test_zero_structure.py checks that no other
module increments a counter by name.
"""

from __future__ import annotations

COUNTERS = (
    "fetches",
    "prefetch_hits",
    "cache_hits",
    "misses",
    "prefetches",
    "evictions",
    "external_gathers",
    "backward_on_demand",
    "grad_flushes",
    "saved_refs",
)
"""Every counter, in the order `engine.stats()` lists them."""


class ScheduleCounters:
    """Fetches, prefetch hits, evictions, gradient flushes, ... of one model, by name (read-only
    from outside: ``counters["fetches"]``, `as_dict`); see [Note: one writer of the schedule counters]."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    def __getitem__(self, name: str) -> int:
        return self._counts[name]

    def as_dict(self) -> dict[str, int]:
        """A copy of every count, by name."""
        return dict(self._counts)

    def count_fetch(self, *, prefetched: bool, cached: bool) -> None:
        """A group's shard fetched into "gpu" for a gather: a prefetch already in flight, a copy
        still resident there (`cached`), or else a miss."""
        c = self._counts
        c["fetches"] += 1
        if prefetched:
            c["prefetch_hits"] += 1
        elif cached:
            c["cache_hits"] += 1
        else:
            c["misses"] += 1

    def count_prefetch(self) -> None:
        """A group's fetch issued ahead of its use."""
        self._counts["prefetches"] += 1

    def count_eviction(self) -> None:
        """A gathered group's "gpu" copy evicted."""
        self._counts["evictions"] += 1

    def count_external_gather(self) -> None:
        """A parameter gathered because an op used it outside its module ([Note: saved tensors
        and external parameters])."""
        self._counts["external_gathers"] += 1

    def count_backward_on_demand(self) -> None:
        """A released group gathered again in backward (a gradient or a saved tensor needed it)."""
        self._counts["backward_on_demand"] += 1

    def count_grad_flush(self) -> None:
        """A group's gradients flushed to their home (reduced across ranks where there are several)."""
        self._counts["grad_flushes"] += 1

    def count_saved_ref(self) -> None:
        """A tensor saved for backward kept as a reference into a gathered buffer, not a copy."""
        self._counts["saved_refs"] += 1
