"""DeepSpeed's entry point for ported scripts: ``engine, optimizer, loader, sched = initialize(...)``.

    import tiered.deepspeed as deepspeed
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model, model_parameters=groups, config="ds_config.json")

The table of DeepSpeed's API and tiered's is docs/deepspeed.md.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from tiered.engine import Engine
from tiered.engine import initialize as _initialize
from tiered.engine.distributed import ensure_process_group
from tiered.errors import ConfigError, DistributedSetupError, UnsupportedConfigError

log = logging.getLogger(__name__)

__all__ = ["Engine", "init_distributed", "initialize"]


def init_distributed(dist_backend: str | None = None) -> None:
    """What DeepSpeed does at initialize: under torchrun (WORLD_SIZE > 1) start the default
    process group (nccl with CUDA, else gloo, or `dist_backend`) unless one exists; the engine's
    own `ensure_process_group` does it, with its checks of the torchrun environment."""
    ensure_process_group(dist_backend)


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    config_params: Any = None,
    dist_backend: str | None = None,
    **hyperparameters: Any,
) -> tuple[Engine, Any, Any, Any]:
    """DeepSpeed's `deepspeed.initialize`, on tiered's engine: returns ``(engine, optimizer,
    dataloader, lr_scheduler)``; `optimizer` is a facade whose param groups carry the lrs
    ([Note: the optimizer facade]), `dataloader` is None without `training_data`, `lr_scheduler`
    the client's (or None). `hyperparameters` are tiered.initialize's (lr=, ...)."""
    if model is None:
        raise ConfigError("tiered.deepspeed.initialize: model= is required")
    if mpu is not None:
        raise UnsupportedConfigError("mpu= (model parallelism) is not supported by tiered; pass mpu=None")
    if config is not None and config_params is not None:
        raise ConfigError("pass config= or config_params= (its old name), not both")
    config = config if config is not None else config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ConfigError("no config: pass config= (a dict or a JSON path), or args with --deepspeed_config")
    if (
        dist_init_required is False
        and int(os.environ.get("WORLD_SIZE", "1")) > 1
        and not dist.is_initialized()
    ):
        raise DistributedSetupError(
            "dist_init_required=False but torch.distributed is not initialised under WORLD_SIZE="
            f"{os.environ['WORLD_SIZE']}: call torch.distributed.init_process_group() first"
        )
    init_distributed(dist_backend)
    out = _initialize(
        model,
        config,
        model_parameters=model_parameters if model_parameters is not None else _all_trainable(model),
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
        **hyperparameters,
    )
    assert isinstance(out, tuple)
    return out


def _all_trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
