"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedulers as a script builds them itself
(``WarmupLR(optimizer, warmup_min_lr=..., ...)``) and passes to ``deepspeed.initialize``.

Each has DeepSpeed's constructor, ``step()``, ``get_lr()``, ``get_last_lr()``,
``last_batch_iteration`` and ``state_dict()``, writes its lrs into the optimizer's groups (at
construction too, as DeepSpeed's), and computes them with the formulas of the config's schedules
(tiered/optim/schedulers.py, [Note: scheduler step indexing]): one schedule per param group, so a
list of min/max lrs gives each group its own, as in DeepSpeed. The engine steps a client scheduler
after every applied step, as DeepSpeed's engine does. OneCycle and LRRangeTest are refused when
built (tiered's config refuses them too).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tiered.errors import UnsupportedConfigError
from tiered.optim.schedulers import LRSchedule
from tiered.optim.schedulers import WarmupCosineLR as _CosineSchedule
from tiered.optim.schedulers import WarmupDecayLR as _DecaySchedule
from tiered.optim.schedulers import WarmupLR as _WarmupSchedule

log = logging.getLogger(__name__)

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
ONE_CYCLE = "OneCycle"
LR_RANGE_TEST = "LRRangeTest"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"expected {n} values for {name}, got {len(value)}")
        return [float(v) for v in value]
    return [float(value)] * n


def _warmup_type(warmup_type: str) -> str:
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        log.warning(
            "Using unknown warmup_type: %s. The increasing function is set to default (log)", warmup_type
        )
        return WARMUP_LOG_RATE
    return warmup_type


class _ClientSchedule:
    """The DeepSpeed scheduler protocol over one tiered schedule per param group."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, schedules: list[LRSchedule], last_batch_iteration: int
    ) -> None:
        self.optimizer = optimizer
        self._schedules = schedules
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None
        if last_batch_iteration == -1:
            self._write(self.get_lr())

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            log.debug("Attempting to get learning rate from scheduler before it has started")
        # lr_at(step) is the lr at last_batch_iteration = step - 1 ([Note: scheduler step indexing])
        return [s.lr_at(max(0, self.last_batch_iteration + 1)) for s in self._schedules]

    def get_last_lr(self) -> list[float]:
        assert self._last_lr is not None, "need to call step() first"
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._write(self.get_lr())

    def _write(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.last_batch_iteration = int(sd["last_batch_iteration"])


class WarmupLR(_ClientSchedule):
    """From warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then constant."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in optimizer.param_groups]
        lows = _per_group(optimizer, warmup_min_lr, "min_lr")
        highs = _per_group(optimizer, warmup_max_lr, "max_lr")
        kind = _warmup_type(warmup_type)
        self.min_lrs, self.max_lrs, self.warmup_num_steps, self.warmup_type = (
            lows,
            highs,
            max(2, warmup_num_steps),
            kind,
        )
        super().__init__(
            optimizer, self._schedules_of(lows, highs, warmup_num_steps, kind), last_batch_iteration
        )

    def _schedules_of(self, lows: list[float], highs: list[float], steps: int, kind: str) -> list[LRSchedule]:
        return [_WarmupSchedule(lo, hi, steps, kind) for lo, hi in zip(lows, highs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at total_num_steps."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )
        if total_num_steps < self.warmup_num_steps:
            log.warning(
                "total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps
            )

    def _schedules_of(self, lows: list[float], highs: list[float], steps: int, kind: str) -> list[LRSchedule]:
        return [
            _DecaySchedule(lo, hi, steps, kind, total_num_steps=self.total_num_steps)
            for lo, hi in zip(lows, highs, strict=True)
        ]


class WarmupCosineLR(_ClientSchedule):
    """The optimizer's lr times a ratio: warmup_min_ratio to 1 over warmup_num_steps, then a cosine
    down to cos_min_ratio at total_num_steps."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = max(2, warmup_num_steps)
        if total_num_steps < self.warmup_num_steps:
            log.warning(
                "total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps
            )
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        kind = _warmup_type(warmup_type)
        schedules: list[LRSchedule] = [
            _CosineSchedule(lr, total_num_steps, warmup_min_ratio, warmup_num_steps, cos_min_ratio, kind)
            for lr in self.org_lrs
        ]
        super().__init__(optimizer, schedules, last_batch_iteration)


class _Refused:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedConfigError(
            f"deepspeed.runtime.lr_schedules.{type(self).__name__}: not supported by tiered (nor in its config); "
            "use WarmupLR, WarmupDecayLR or WarmupCosineLR, or any torch.optim.lr_scheduler built on the optimizer "
            "deepspeed.initialize returns"
        )


class OneCycle(_Refused):
    """DeepSpeed's 1Cycle schedule (with momentum cycling): refused when built."""


class LRRangeTest(_Refused):
    """DeepSpeed's LR range test: refused when built."""
