"""The parts of `Engine.stats()` that compare the memory model's promises with the run: the host
peak ([Note: one memory model]) and the bytes moved per step ([Note: bytes per step])."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiered.engine.parts import EngineParts


def host_memory_stats(parts: EngineParts) -> dict[str, Any]:
    """The host peak the memory model promises for this run (the host tiers' need, the process
    baseline, the transients outside the tiers, the backends' buffers, the imports beyond the
    baseline), next to the process's peak RSS so far (``ru_maxrss``)."""
    import resource

    extra = parts.host_memory
    tiers = sum(int(d["total"]) for t, d in parts.capacity.items() if parts.tier_memory.get(t) == "host")
    # the copies the host tiers keep across steps, inside their budgets ([Note: residency])
    tiers += sum(parts.residency.bytes_in(t) for t, m in parts.tier_memory.items() if m == "host")
    planned = tiers + int(extra.get("baseline", 0)) + int(extra.get("outside_tiers", 0))
    planned += sum(extra.get("backends", {}).values()) + int(extra.get("imports", 0))
    planned += int(extra.get("live", 0))  # the live budget's parameters where "gpu" is host memory
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {**extra, "tiers": tiers, "planned_peak_bytes": planned, "peak_rss_bytes": rss_kib * 1024}


def bytes_per_step_stats(parts: EngineParts, steps: int) -> dict[str, Any]:
    """The floor of [Note: bytes per step] next to what the tier manager moved per step so far
    (every link's bytes since initialize, over the `steps` optimizer steps taken; the first step
    includes the moves of initialize's writes and the first gather)."""
    from tiered.planning.traffic import measured_per_step

    links = parts.tm.stats().get("links", {})
    return {
        "formula": dict(parts.traffic_floor),
        "measured": measured_per_step(links, parts.tier_memory, steps) if steps else None,
        "steps": steps,
    }
