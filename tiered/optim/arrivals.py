"""The order in which one step's groups became ready to update (lifetime: one step).

The plain step puts every group that received a gradient at once; the overlapped step
([Note: step overlapped with backward] in tiered/optim/offload.py) puts each as backward
completes its gradients, while the pipeline's stepper thread takes them.
"""

from __future__ import annotations

import threading


class Arrivals:
    """Group indices in the order they became ready to step; each index once. `get(k)` blocks
    until the k-th arrived (or returns None once closed with fewer)."""

    def __init__(self, timeout_s: float) -> None:
        self._items: list[int] = []
        self._seen: set[int] = set()
        self._closed = False
        self._cv = threading.Condition()
        self._timeout_s = timeout_s

    def put(self, i: int) -> None:
        with self._cv:
            if i in self._seen or self._closed:
                return
            self._seen.add(i)
            self._items.append(i)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def available(self) -> int:
        with self._cv:
            return len(self._items)

    def at(self, k: int) -> int:
        with self._cv:
            return self._items[k]

    def get(self, k: int) -> int | None:
        with self._cv:
            if not self._cv.wait_for(lambda: len(self._items) > k or self._closed, timeout=self._timeout_s):
                raise TimeoutError(
                    f"overlapped optimizer step: no group became ready within {self._timeout_s:.0f} s "
                    "(tiered.timeout_s); did backward stop without engine.step()?"
                )
            return self._items[k] if len(self._items) > k else None
