"""The recorded trace of group fetches, the prefetch cursor and the Belady eviction policy.

[Note: trace and re-synchronisation]
A *pass* is one forward (and its backward, if any). The first pass records the order in which
groups are gathered (forward and backward). Later passes walk a cursor along that trace: each
gather that matches the expected group advances the cursor, and the groups ahead of it (up to
``stage3_prefetch_bucket_size`` elements) are prefetched. A gather that does not match (dynamic
control flow: a branch taken differently) is looked up ahead in the trace; if found, the cursor
jumps there (a *resync*); if not, it is a *divergence*: the group is fetched on demand, and at the
end of the pass the trace is replaced by the one just observed. Prefetching is never disabled
for good: the next pass prefetches from the new trace, and a pass that matches again costs
nothing. Correctness never depends on the trace: a gather always fetches what it needs.

[Note: Belady eviction]
Because a training step replays the same schedule, the partition whose next use is furthest in
the future is known, and evicting it first is optimal (Belady's rule). `BeladyPolicy` orders
the "gpu" tier's eviction candidates that way: groups not used again in this pass first, then
by decreasing distance to their next use; persistent groups last; partitions the scheduler does
not know (optimizer state) after the unused groups, in the manager's own order.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiered.tiers import Partition

log = logging.getLogger(__name__)

# How far ahead (in trace positions) a mismatched gather is looked up before it counts as a
# divergence: far enough to skip a few conditional layers, short enough to stay cheap.
_RESYNC_WINDOW = 64


class Trace:
    """Group fetch order: recorded, replayed, re-synchronised. See [Note: trace and re-synchronisation]."""

    def __init__(self, numel_of: Sequence[int]) -> None:
        self._numel = list(numel_of)
        self.trace: list[int] = []
        self._index: tuple[dict[int, list[int]], list[int]] = ({}, [0])
        self.observed: list[int] = []
        self.cursor = 0
        self.recording = True  # until a first pass completed
        self.diverged = False
        self.in_pass = False
        self.passes = 0
        self.hits_in_order = 0
        self.resyncs = 0
        self.divergences = 0
        self.invalidations = 0

    def _set_trace(self, trace: list[int]) -> None:
        # positions of each group and cumulative elements: next-use queries in O(log n); one
        # tuple, swapped in one assignment, because the eviction policy reads it from the
        # manager's loop thread
        positions: dict[int, list[int]] = {}
        prefix = [0]
        for pos, idx in enumerate(trace):
            positions.setdefault(idx, []).append(pos)
            prefix.append(prefix[-1] + self._numel[idx])
        self.trace = trace
        self._index = (positions, prefix)

    def begin_pass(self) -> None:
        self.observed = []
        self.cursor = 0
        self.diverged = False
        self.in_pass = True

    def end_pass(self) -> None:
        if not self.in_pass:
            return
        self.in_pass = False
        self.passes += 1
        if self.recording or self.diverged or len(self.observed) != len(self.trace):
            if not self.recording:
                self.invalidations += 1
            self._set_trace(self.observed)
            self.recording = False
        self.observed = []
        self.cursor = 0

    def on_gather(self, idx: int) -> None:
        """Record a gather of group `idx` and move the cursor past its expected position."""
        self.observed.append(idx)
        if self.recording:
            return
        t = self.trace
        if self.cursor < len(t) and t[self.cursor] == idx:
            self.cursor += 1
            self.hits_in_order += 1
            return
        end = min(len(t), self.cursor + _RESYNC_WINDOW)
        for j in range(self.cursor, end):
            if t[j] == idx:
                self.cursor = j + 1
                self.resyncs += 1
                return
        self.divergences += 1
        self.diverged = True

    def upcoming(self, bucket_numel: int) -> list[int]:
        """Groups expected next, in order, until `bucket_numel` elements are covered."""
        if self.recording:
            return []
        out: list[int] = []
        seen: set[int] = set()
        total = 0
        for idx in self.trace[self.cursor :]:
            if idx in seen:
                continue
            if total >= bucket_numel:
                break
            seen.add(idx)
            out.append(idx)
            total += self._numel[idx]
        return out

    def next_use_distance(self, idx: int) -> int | None:
        """Elements gathered before group `idx` is used again in this pass; None if not again."""
        if self.recording:
            return 0  # nothing known yet: treat as reused soon, the budget decides
        index, prefix = self._index
        positions = index.get(idx)
        if not positions:
            return None
        cursor = min(self.cursor, len(prefix) - 1)
        k = bisect_left(positions, cursor)
        if k == len(positions):
            return None
        return prefix[positions[k]] - prefix[cursor]

    def stats(self) -> dict[str, int]:
        return {
            "passes": self.passes,
            "trace_len": len(self.trace),
            "in_order": self.hits_in_order,
            "resyncs": self.resyncs,
            "divergences": self.divergences,
            "trace_invalidations": self.invalidations,
        }


class BeladyPolicy:
    """EvictionPolicy for the "gpu" tier. See [Note: Belady eviction]."""

    def __init__(
        self, group_of: Callable[[str], int | None], trace: Trace, persistent: Callable[[int], bool]
    ):
        self._group_of = group_of
        self._trace = trace
        self._persistent = persistent

    def choose(self, tier: str, candidates: Sequence[Partition], need_bytes: int) -> Sequence[Partition]:
        inf = float("inf")

        def key(item: tuple[int, Partition]) -> tuple[int, float, int]:
            pos, part = item
            idx = self._group_of(part.name)
            if idx is None:  # not a parameter group: after the unused groups, manager order kept
                return (1, 0.0, pos)
            if self._persistent(idx):
                return (3, 0.0, pos)
            dist = self._trace.next_use_distance(idx)
            if dist is None:
                return (0, 0.0, pos)
            return (2, -float(dist) if dist != inf else -inf, pos)

        try:
            return [p for _, p in sorted(enumerate(candidates), key=key)]
        except Exception:
            log.exception("Belady policy failed; using the manager's order")
            return list(candidates)
