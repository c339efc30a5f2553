"""What more memory would buy: the search's configs weighed again at larger memories.

[Note: what more memory buys]
A plan answers for the memories given; the next question is what more would buy ([Note:
residency]: memory given becomes fewer bytes moved). So beside the fastest config, `tiered plan`
weighs the same configs again with one memory larger at a time: the host memory, then the GPU,
each at +25 %, +50 % and +100 % of what was given, and says the fastest that fits there and how
many seconds per step it saves. Only the placement table's configs are weighed again (per
placement its fastest, or its closest to fitting: `SearchResult.per_placement`), their other
sized knobs (``max_in_cpu``, the live budget, what the tiers keep, the GPU's room: [Note: the
GPU's room searched]) sized afresh for the larger memory, so each line is a config that memory would run, not an extrapolation; the full grid
would find at least that. One more line answers how much host memory moves nothing on NVMe:
the fastest config whose disk traffic is zero, weighed with the host memory unbounded, and its
host peak (the memory it needs); none where the model does not fit without NVMe at all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tiered.planning.gpu_room import fill_gpu_room
from tiered.planning.search import (
    PLACEMENT_KNOBS,
    Candidate,
    SearchResult,
    _fastest,
    _weigh,
    _weigh_at,
)

STEPS = (0.25, 0.5, 1.0)
"""The larger memories weighed: each memory given, plus these fractions of it."""
_SIZED = ("sub_group_size", "buffer_count", "persistence_threshold", "prefetch_bucket_size")


@dataclass(frozen=True)
class MoreMemory:
    """One line of [Note: what more memory buys]."""

    memory: str
    """"cpu" (host memory) or "gpu"."""
    given_bytes: int
    bytes: int
    """The memory weighed: `given_bytes` and more."""
    best: Candidate | None
    """The fastest config that fits there (None: still nothing)."""
    saved_seconds: float | None
    """Seconds per step saved against the plan's own best (None: nothing fitted before)."""
    nothing_on_disk: bool = False
    """The line of the host memory that moves nothing on NVMe (its `bytes` is that config's peak)."""


def _grid_knobs(c: Candidate, result: SearchResult) -> dict[str, Any]:
    """The searched knobs of `c`, the sized ones left to be sized again."""
    knobs = {k: c.knobs[k] for k in (*PLACEMENT_KNOBS, *_SIZED) if k in c.knobs}
    return {**knobs, "max_in_cpu": None, "overlap_step": result.pinned.get("overlap_step")}


def _reweighed(result: SearchResult, placements: Any = None, **memories: int | None) -> list[Candidate]:
    """The placement table's configs weighed again at `memories` (only `placements`' where given)."""
    assert result.setup is not None
    s = dataclasses.replace(result.setup, mem=dataclasses.replace(result.setup.mem, **memories))
    live = result.pinned.get("max_live_parameters")
    rows = [c for c in result.per_placement() if c.prediction is not None]
    return [_weigh(s, _grid_knobs(c, result), live) for c in rows if placements is None or placements(c)]


def _best_at(result: SearchResult, **memories: int | None) -> Candidate | None:
    assert result.setup is not None
    s = dataclasses.replace(result.setup, mem=dataclasses.replace(result.setup.mem, **memories))
    ratio_pinned = result.pinned.get("ratio") is not None
    weighed = _reweighed(result, **memories)
    return _fastest(fill_gpu_room(s, c, ratio_pinned, _weigh_at) for c in weighed if c.fits)


def what_more_memory_buys(result: SearchResult, steps: tuple[float, ...] = STEPS) -> list[MoreMemory]:
    """[Note: what more memory buys] for `result` (a `search`'s): per memory given and step, the
    fastest config there; then the host memory that moves nothing on NVMe."""
    if result.setup is None:
        return []
    mem, now = result.setup.mem, result.best
    out: list[MoreMemory] = []

    def saved(c: Candidate | None) -> float | None:
        return None if c is None or now is None else now.seconds_per_step - c.seconds_per_step

    for memory in ("cpu", "gpu"):
        have = getattr(mem, memory)
        if not have:
            continue
        for f in steps:
            more = have + int(have * f)
            c = _best_at(result, **{memory: more})
            out.append(MoreMemory(memory, have, more, c, saved(c)))
    if mem.cpu and now is not None and (now.traffic.get("disk->host", 0) or now.traffic.get("host->disk", 0)):
        c = _off_disk(result)
        if c is not None:
            out.append(MoreMemory("cpu", mem.cpu, c.peaks["host"], c, saved(c), nothing_on_disk=True))
    return out


def _off_disk(result: SearchResult) -> Candidate | None:
    """The fastest config that moves nothing on NVMe with the host memory unbounded."""
    weighed = _reweighed(result, lambda c: "nvme" not in c.placement, cpu=None)
    return _fastest(
        c for c in weighed if c.fits and not c.traffic.get("disk->host") and not c.traffic.get("host->disk")
    )
