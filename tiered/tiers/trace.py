"""Chrome-trace events for every move, so a step's I/O can be inspected in chrome://tracing
or Perfetto: one complete ("X") event per move, one track per link, bytes in ``args``.

[Note: trace lanes]
Perfetto (like chrome://tracing) expects the complete events of one thread track to nest;
moves on one link overlap (up to max_inflight_per_link at once) without nesting, which Perfetto
reports as import errors and draws wrongly. So a track is written as as many lanes ("cpu->gpu",
"cpu->gpu #2", ...) as it has overlapping events at once: each event goes to the first lane
that is free at its start (interval partitioning over events sorted by start). Other layers add
their own tracks (module compute, the Adam per group, the steps) through `add` with the same
clock, `time.perf_counter()`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


class TraceRecorder:
    """Collects complete events; thread-safe (moves finish on the loop, stalls on callers)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._tids: dict[str, int] = {}

    def _tid(self, track: str) -> int:
        tid = self._tids.get(track)
        if tid is None:
            tid = self._tids[track] = len(self._tids) + 1
        return tid

    def add(self, name: str, cat: str, start_s: float, end_s: float, **args: Any) -> None:
        """Record one complete event on track `cat`; `start_s`/`end_s` are `time.perf_counter()`
        readings."""
        if not self.enabled:
            return
        with self._lock:
            self._events.append(
                {
                    "name": name,
                    "cat": cat,
                    "ph": "X",
                    "ts": (start_s - self._t0) * 1e6,
                    "dur": max(0.0, (end_s - start_s) * 1e6),
                    "pid": os.getpid(),
                    "tid": self._tid(cat),
                    "args": args,
                }
            )

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(e) for e in self._events]

    def to_json(self) -> dict[str, Any]:
        """The trace in Chrome's JSON object format, each track split into lanes whose events
        do not overlap ([Note: trace lanes])."""
        with self._lock:
            events = sorted((dict(e) for e in self._events), key=lambda e: (e["ts"], -e["dur"]))
        pid = os.getpid()
        lane_ends: dict[str, list[float]] = {}
        tids: dict[tuple[str, int], int] = {}
        for e in events:
            ends = lane_ends.setdefault(e["cat"], [])
            lane = next((i for i, end in enumerate(ends) if end <= e["ts"]), len(ends))
            if lane == len(ends):
                ends.append(0.0)
            ends[lane] = e["ts"] + e["dur"]
            e["tid"] = tids.setdefault((e["cat"], lane), len(tids) + 1)
        meta: list[dict[str, Any]] = []
        for (track, lane), tid in tids.items():
            name = track if lane == 0 else f"{track} #{lane + 1}"
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            meta.append(
                {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
            )
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike[str]) -> None:
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f)
        os.replace(tmp, path)
