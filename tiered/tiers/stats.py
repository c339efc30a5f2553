"""Counters the manager keeps: per tier bytes and op counts, per link bytes and busy time,
stall time of the training thread, evictions and write-backs.

[Note: link busy time]
A link's ``seconds`` is the wall time during which at least one move was in flight on it (the
union of the moves' intervals, not their sum), so ``gbps = bytes / seconds`` is the bandwidth
the link delivered while busy, and concurrent moves are not double-counted.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tiered.tiers.io_policy import IOCounters


@dataclass
class LinkStats:
    bytes: int = 0
    ops: int = 0
    busy_s: float = 0.0
    active: int = 0
    max_active: int = 0
    _since: float = 0.0

    def begin(self) -> None:
        if self.active == 0:
            self._since = time.perf_counter()
        self.active += 1
        self.max_active = max(self.max_active, self.active)

    def end(self, nbytes: int, ok: bool) -> None:
        self.active -= 1
        if self.active == 0:
            self.busy_s += time.perf_counter() - self._since
        if ok:
            self.bytes += nbytes
            self.ops += 1

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "seconds": self.busy_s,
            "gbps": (self.bytes / self.busy_s / 1e9) if self.busy_s > 0 else 0.0,
            "ops": self.ops,
            "max_inflight": self.max_active,
        }


@dataclass
class TierCounters:
    reads: int = 0
    writes: int = 0
    stall_s: float = 0.0


@dataclass
class ManagerStats:
    """Mutated on the loop thread, except stalls, which callers add under the lock."""

    tiers: dict[str, TierCounters] = field(default_factory=dict)
    links: dict[str, LinkStats] = field(default_factory=dict)
    evictions: int = 0
    writebacks: int = 0
    clean_drops: int = 0
    kept_evictions: int = 0
    """Kept copies ([Note: kept copies]) evicted because their tier needed the room."""
    stall_s: float = 0.0
    io: IOCounters = field(default_factory=IOCounters)
    """Retries, timeouts and checksum verification of backend calls."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def link(self, src: str, dst: str) -> LinkStats:
        key = f"{src}->{dst}"
        ls = self.links.get(key)
        if ls is None:
            ls = self.links[key] = LinkStats()
        return ls

    def add_stall(self, tier: str | None, seconds: float) -> None:
        with self._lock:
            self.stall_s += seconds
            if tier is not None and tier in self.tiers:
                self.tiers[tier].stall_s += seconds

    def to_json(self, tier_extra: dict[str, dict[str, Any]]) -> dict[str, Any]:
        with self._lock:
            return {
                "tiers": {
                    name: {
                        **tier_extra.get(name, {}),
                        "reads": c.reads,
                        "writes": c.writes,
                        "stall_s": c.stall_s,
                    }
                    for name, c in self.tiers.items()
                },
                "links": {k: v.to_json() for k, v in list(self.links.items())},
                "stall_s": self.stall_s,
                "evictions": self.evictions,
                "writebacks": self.writebacks,
                "clean_drops": self.clean_drops,
                "kept_evictions": self.kept_evictions,
                "io": self.io.to_json(),
            }
