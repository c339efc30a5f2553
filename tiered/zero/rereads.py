"""Which gathered groups the backward reads a second time: the engine's keep rules for the
"gpu" tier between a group's forward and backward use, replayed on the trace ([Note: the live
budget] in budget.py). [Note: bytes per step], the residency plan, the persistence by room of
layout.py and the bench's replayed pattern all take the answer from here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiered.shards import ShardGroup


def reread_groups(
    groups: Sequence[ShardGroup], *, max_live_numel: int | None, max_reuse_numel: int | None
) -> set[int]:
    """The indices of the gathered groups the backward reads a second time (`backward_rereads`
    over every non-persistent group not homed on the GPU; None: unbounded). The one answer
    [Note: bytes per step], the residency plan and the bench's replayed pattern
    ([Note: training I/O pattern]) use."""
    gathered = [g for g in groups if not g.persistent and g.param.home != "gpu"]
    every = sum(g.shard_numel for g in gathered)
    return {
        gathered[j].index
        for j in backward_rereads(
            [g.shard_numel for g in gathered],
            [False] * len(gathered),
            max_live_numel if max_live_numel is not None else every,
            max_reuse_numel if max_reuse_numel is not None else every,
        )
    }


def backward_rereads(numel: list[int], persistent: list[bool], max_live: int, max_reuse: int) -> set[int]:
    """Which groups (by position in `numel`, forward order) the backward must read again, having
    been evicted from "gpu" after their forward use: the engine's rules replayed on the trace
    forward order + reverse order ([Note: the live budget]): after a release a group goes when
    its next use is further than ``stage3_max_reuse_distance`` elements away; before a fetch,
    released groups go, furthest next use first, until ``stage3_max_live_parameters`` has room.
    Persistent groups stay for the whole step."""
    trace = list(range(len(numel))) + list(reversed(range(len(numel))))
    prefix = [0]
    for i in trace:
        prefix.append(prefix[-1] + numel[i])
    uses: dict[int, list[int]] = {}
    for t, i in enumerate(trace):
        uses.setdefault(i, []).append(t)

    def next_use(i: int, t: int) -> float:
        later = [u for u in uses[i] if u > t]
        return float("inf") if not later else float(prefix[later[0]] - prefix[t + 1])

    live: dict[int, int] = {}
    reread: set[int] = set()
    for t, i in enumerate(trace):
        if persistent[i]:
            continue
        if i not in live:
            if t >= len(numel):
                reread.add(i)
            for v in sorted(live, key=lambda v: next_use(v, t), reverse=True):
                if sum(live.values()) + numel[i] <= max_live:
                    break
                del live[v]
            live[i] = numel[i]
        if next_use(i, t) > max_reuse:
            live.pop(i, None)
    return reread
