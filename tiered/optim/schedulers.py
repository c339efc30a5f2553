"""Learning-rate schedules with DeepSpeed's semantics (deepspeed/runtime/lr_schedules.py).

A schedule here is a pure function of the step count, `lr_at(step)`, not an object that mutates
an optimizer: the engine asks for the lr of the step it is about to take, and checkpoints need
only the step count.

[Note: scheduler step indexing]
``lr_at(step)`` is the lr DeepSpeed uses for the optimizer step taken when ``step`` steps have
already been taken (step = 0 for the first step). DeepSpeed's engine builds the scheduler with
``last_batch_iteration = -1`` (which already writes an lr into the optimizer) and calls
``scheduler.step()`` *after* each optimizer step, so step k runs with the scheduler's
``get_lr()`` at ``last_batch_iteration = k - 1``. We replicate that exactly, including its
consequences: at k = 0 WarmupLR/WarmupDecayLR give warmup_min_lr and WarmupCosineLR gives 0.0; at
k = 1 a log or linear warmup is still at its start value (log(1) = 0, 0 / n = 0). Steps skipped
for fp16 overflow do not advance DeepSpeed's scheduler, so the engine passes the count of steps
actually applied.

Formulas, with i = last_batch_iteration = step - 1 and W = max(2, warmup_num_steps):
  warmup fraction g(i) = log(i + 1) / log(W)   ("log")   or   i / W   ("linear"),  for i < W
  WarmupLR:       lr = min_lr + (max_lr - min_lr) * (g(i) if i < W else 1)
  WarmupDecayLR:  as WarmupLR while i < W; then
                  lr = min_lr + (max_lr - min_lr) * max(0, (T - i) / max(1, T - W))
  WarmupCosineLR: ratio = warmup_min_ratio + (1 - warmup_min_ratio) * g(i)  while i < W; then
                  p = min(1, (i - W + 1) / max(1, T - W)),
                  ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2);
                  lr = base_lr * ratio
WarmupLR and WarmupDecayLR ignore the optimizer's lr (they set warmup_max_lr), as DeepSpeed does;
WarmupCosineLR scales it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from tiered.config.scheduler import normalize_scheduler, scheduler_type
from tiered.config.schema import SchedulerConfig
from tiered.config.values import as_count, is_auto
from tiered.errors import ConfigError


class LRSchedule(Protocol):
    def lr_at(self, step: int) -> float: ...


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(
            f"lr_at: step must be the number of optimizer steps taken (an int >= 0), got {step!r}"
        )
    return step


def _warmup_fraction(i: int, warmup_steps: int, warmup_type: str) -> float:
    if warmup_type == "log":
        return math.log(i + 1) / math.log(warmup_steps)
    return i / warmup_steps


@dataclass(frozen=True)
class ConstantLR:
    """No scheduler configured: every step uses the optimizer's lr."""

    lr: float

    def lr_at(self, step: int) -> float:
        _check_step(step)
        return self.lr


@dataclass(frozen=True)
class WarmupLR:
    warmup_min_lr: float = 0.0
    warmup_max_lr: float = 0.001
    warmup_num_steps: int = 1000
    warmup_type: str = "log"

    @property
    def _w(self) -> int:
        return max(2, self.warmup_num_steps)

    def _gamma(self, i: int) -> float:
        if i < self._w:
            return _warmup_fraction(i, self._w, self.warmup_type)
        return 1.0

    def lr_at(self, step: int) -> float:
        i = _check_step(step) - 1
        if i < 0:
            return self.warmup_min_lr
        return self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * self._gamma(i)


@dataclass(frozen=True)
class WarmupDecayLR(WarmupLR):
    total_num_steps: int = 1

    def _gamma(self, i: int) -> float:
        if i < self._w:
            return _warmup_fraction(i, self._w, self.warmup_type)
        return max(0.0, (self.total_num_steps - i) / max(1.0, self.total_num_steps - self._w))


@dataclass(frozen=True)
class WarmupCosineLR:
    base_lr: float
    total_num_steps: int
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = 1000
    cos_min_ratio: float = 0.0001
    warmup_type: str = "log"

    def ratio_at(self, step: int) -> float:
        i = _check_step(step) - 1
        if i < 0:
            return 0.0
        w = max(2, self.warmup_num_steps)
        if i < w:
            g = _warmup_fraction(i, w, self.warmup_type)
            return self.warmup_min_ratio + g * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (i - w + 1) / max(1, self.total_num_steps - w))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, step: int) -> float:
        return self.base_lr * self.ratio_at(step)


def build_scheduler(
    cfg: SchedulerConfig | None, *, base_lr: float, total_steps: int | None = None
) -> LRSchedule:
    """The schedule for `cfg` (None: constant `base_lr`).

    `base_lr` is the optimizer's lr (cfg.optimizer.lr); it resolves "auto" / missing
    warmup_max_lr and scales WarmupCosineLR. `total_steps` (optimizer steps in the run) resolves
    total_num_steps "auto"; an explicit total_num_steps wins over it.
    """
    if cfg is None:
        return ConstantLR(float(base_lr))
    kind = scheduler_type(cfg.type)
    params: dict[str, Any] = normalize_scheduler(kind, cfg.params, base_lr=base_lr)
    if params.get("total_num_steps") is not None and is_auto(params["total_num_steps"]):
        if total_steps is None:
            raise ConfigError(
                f'scheduler.params.total_num_steps is "auto" for {kind}: pass total_steps= '
                "(the number of optimizer steps in the run) to build_scheduler, or write a number"
            )
        params["total_num_steps"] = as_count(total_steps, "build_scheduler(total_steps=)", minimum=1)
    if kind == "WarmupLR":
        return WarmupLR(
            params["warmup_min_lr"],
            params["warmup_max_lr"],
            params["warmup_num_steps"],
            params["warmup_type"],
        )
    if kind == "WarmupDecayLR":
        return WarmupDecayLR(
            params["warmup_min_lr"],
            params["warmup_max_lr"],
            params["warmup_num_steps"],
            params["warmup_type"],
            total_num_steps=params["total_num_steps"],
        )
    return WarmupCosineLR(
        base_lr=float(base_lr),
        total_num_steps=params["total_num_steps"],
        warmup_min_ratio=params["warmup_min_ratio"],
        warmup_num_steps=params["warmup_num_steps"],
        cos_min_ratio=params["cos_min_ratio"],
        warmup_type=params["warmup_type"],
    )
