"""``deepspeed.runtime``: the engine class, the lr schedules a script builds itself, ``zero``,
activation checkpointing, and the small helpers DeepSpeed scripts import from it."""

from __future__ import annotations

from tiered.deepspeed.runtime import (
    activation_checkpointing,
    compiler,
    dataloader,
    engine,
    lr_schedules,
    utils,
    zero,
)
from tiered.deepspeed.runtime.engine import DeepSpeedEngine

__all__ = [
    "DeepSpeedEngine",
    "activation_checkpointing",
    "compiler",
    "dataloader",
    "engine",
    "lr_schedules",
    "utils",
    "zero",
]
