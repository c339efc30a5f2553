"""Configuration: `load_config` (tiered or DeepSpeed JSON -> resolved `TieredConfig`),
`dump_config` (the reverse) and `apply_overrides` (the command line's flags over a raw config).
See keys.py for how every key is treated."""

from __future__ import annotations

from tiered.config.dump import dump_config
from tiered.config.hyper import Hyperparameters, check_complete
from tiered.config.keys import ignored_keys_table
from tiered.config.loader import load_config
from tiered.config.overrides import apply_overrides
from tiered.config.schema import (
    AioConfig,
    OptimizerConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
    PrecisionConfig,
    SchedulerConfig,
    TieredConfig,
    TieredSection,
    TierSpec,
    ZeroConfig,
)

__all__ = [
    "AioConfig",
    "Hyperparameters",
    "OptimizerConfig",
    "OptimizerOffloadConfig",
    "ParamOffloadConfig",
    "PrecisionConfig",
    "SchedulerConfig",
    "TierSpec",
    "TieredConfig",
    "TieredSection",
    "ZeroConfig",
    "apply_overrides",
    "check_complete",
    "dump_config",
    "ignored_keys_table",
    "load_config",
]
