"""Chrome-trace events for every move, so a step's I/O can be inspected in chrome://tracing
or Perfetto: one complete ("X") event per move, one track per link, bytes in ``args``."""

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
        """Record one complete event; `start_s`/`end_s` are `time.perf_counter()` readings."""
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
        with self._lock:
            meta = [
                {"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": tid, "args": {"name": track}}
                for track, tid in self._tids.items()
            ]
            return {"traceEvents": meta + [dict(e) for e in self._events], "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike[str]) -> None:
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f)
        os.replace(tmp, path)
