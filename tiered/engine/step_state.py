"""The engine's per-step state, as values: `StepState` (the counters and the open accumulation
window, replaced whole at every transition) and `StepTimes` (the seconds spent per phase).

`Engine` is their one owner. A transition is a new value (`dataclasses.replace`), so a window
ends in one place (`StepState.window_ended`), whether by a step, `zero_grad` or a checkpoint load,
and nothing is half reset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Window:
    """What the backwards of the open accumulation window saw ([Note: engine step semantics])."""

    backward_seen: bool = False
    """A backward ran since the last step (a step at the boundary needs one)."""
    found_inf: bool = False
    """fp16: some gradient of the window overflowed."""
    sq_norm_local: float = 0.0
    """This rank's squared gradient norm of the window (the last backward's summary)."""


@dataclass(frozen=True)
class StepState:
    """The engine's counters (DeepSpeed's meanings: [Note: engine step semantics]) and its open
    window; the counters are the checkpoint's training state."""

    micro_steps: int = 0
    global_steps: int = 0
    """Accumulation boundaries, skipped steps included."""
    skipped_steps: int = 0
    last_grad_norm: float | None = None
    """The last step's global gradient norm before clipping: nan where nothing computed it, inf
    after an fp16 overflow, None before the first step and after a checkpoint load."""
    step_applied: bool = False
    """The last `step()` updated the parameters."""
    window: Window = field(default_factory=Window)

    def at_boundary(self, gas: int) -> bool:
        """The next micro-batch ends an accumulation window."""
        return (self.micro_steps + 1) % gas == 0

    def after_backward(self, *, found_inf: bool, sq_norm_local: float) -> StepState:
        w = self.window
        return replace(
            self,
            window=Window(
                backward_seen=True, found_inf=w.found_inf or found_inf, sq_norm_local=sq_norm_local
            ),
        )

    def window_ended(self) -> StepState:
        return replace(self, window=Window())

    def counters(self) -> dict[str, int]:
        """The checkpoint's part of this state."""
        return {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
        }

    def stats(self) -> dict[str, Any]:
        """`Engine.stats()`'s counters; a norm that is not finite (none computed, an overflow) is None."""
        norm = self.last_grad_norm
        return {
            "global_steps": self.global_steps,
            "skipped_steps": self.skipped_steps,
            "micro_steps": self.micro_steps,
            "last_grad_norm": None if norm is None or not math.isfinite(norm) else norm,
        }

    def restored(self, training: dict[str, Any]) -> StepState:
        """A checkpoint's training section loaded: its counters, no last norm, a new window."""
        return replace(
            self,
            micro_steps=int(training["micro_steps"]),
            global_steps=int(training["global_steps"]),
            skipped_steps=int(training["skipped_steps"]),
            last_grad_norm=None,
            window=Window(),
        )


PHASES = ("forward_s", "backward_s", "step_s", "optimizer_s")


class StepTimes:
    """Seconds per phase: the totals since initialize, and those of the last optimizer step (all
    of its micro-batches), which `steps_per_print`'s wall-clock line and `stats()` report."""

    def __init__(self) -> None:
        self.total = dict.fromkeys(PHASES, 0.0)
        self.last_step: dict[str, float] = {}
        self._current: dict[str, float] = {}
        """The window in progress: its forwards and backwards so far."""

    def add(self, phase: str, seconds: float) -> None:
        """A forward or backward of the window in progress."""
        self.total[phase] += seconds
        self._current[phase] = self._current.get(phase, 0.0) + seconds

    def stats(self) -> dict[str, dict[str, float]]:
        return {"total": dict(self.total), "last_step": dict(self.last_step)}

    def step_done(self, seconds: float) -> None:
        """The window's step ended: it becomes the last step's timing."""
        self.total["step_s"] += seconds
        self._current["step_s"] = seconds
        self.last_step = self._current
        self._current = {}
