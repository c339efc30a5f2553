"""The order in which one step's groups became ready to update (lifetime: one step).

The plain step puts every group that received a gradient at once; the overlapped step
([Note: step overlapped with backward] in tiered/optim/offload.py) puts each as backward
completes its gradients, while the pipeline's stepper thread takes them.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tiered.config.schema import TieredConfig

log = logging.getLogger(__name__)


def overlap_blockers(cfg: TieredConfig) -> list[str]:
    """Why `tiered.overlap_step_with_backward` cannot apply to `cfg` (empty: it applies, or was
    not asked for): what needs the whole gradient before the first update."""
    if not cfg.zero.overlap_step_with_backward:
        return []
    blockers = []
    if float(cfg.gradient_clipping) > 0:
        blockers.append(f"gradient_clipping={cfg.gradient_clipping} needs the global gradient norm first")
    if cfg.precision.dtype == torch.float16:
        blockers.append("fp16 needs the overflow check over every gradient first")
    return blockers


def overlap_step_applies(cfg: TieredConfig) -> bool:
    """tiered.overlap_step_with_backward, where nothing needs the whole gradient before the first
    update: no gradient clipping (a global norm) and no fp16 overflow check. Warns otherwise."""
    blockers = overlap_blockers(cfg)
    if blockers:
        log.warning(
            "tiered.overlap_step_with_backward has no effect: %s; the step runs after backward",
            "; ".join(blockers),
        )
    return bool(cfg.zero.overlap_step_with_backward) and not blockers


def grads_consumed_from_memory(cfg: TieredConfig) -> bool:
    """Whether the step takes each gradient from memory instead of its home: the step overlaps
    backward and there is no accumulation ([Note: gradient consumed from memory] in
    tiered/optim/group.py). The engine and [Note: bytes per step] both ask this."""
    return (
        cfg.zero.overlap_step_with_backward
        and not overlap_blockers(cfg)
        and int(cfg.gradient_accumulation_steps) == 1
    )


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
