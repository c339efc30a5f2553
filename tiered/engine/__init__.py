"""`tiered.initialize(model, config) -> Engine`: config, tiers, ZeRO-3 partitions, offloaded Adam."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from tiered.config.schema import TieredConfig
from tiered.engine.build import (
    Placement,
    build_tier_manager,
    capacity_needs,
    check_capacity,
    check_not_managed,
    choose_placement,
    mark_managed,
)
from tiered.engine.engine import Engine

log = logging.getLogger(__name__)

__all__ = ["Engine", "Placement", "initialize"]


def initialize(
    model: torch.nn.Module,
    config: dict[str, Any] | str | os.PathLike[str] | TieredConfig,
    *,
    process_group: Any = None,
    **hyperparameters: Any,
) -> Engine:
    """Partition `model` into shard groups over the configured tiers and return the Engine.

    `config` is tiered's JSON or an unchanged DeepSpeed JSON (dict or path), or a resolved
    TieredConfig. Under torch.distributed (torchrun) the data-parallel group is the default
    group unless `process_group` is given. Every budget is checked before training starts
    (see [Note: capacity check before training]). `hyperparameters` (lr=, betas=, eps=,
    weight_decay=, warmup_steps=, total_steps=, micro_batch_size=, gradient_accumulation_steps=,
    max_grad_norm=, mixed_precision=) fill the config's "auto" as Hugging Face's Trainer does; a
    hyper-parameter neither gives is a ConfigError (see tiered.config.hyper).
    """
    from tiered.config.loader import config_for_training
    from tiered.optim.offload import OffloadedAdam
    from tiered.optim.placement import pipeline_bytes, plan_optimizer_placement, tier_is_host
    from tiered.zero import ZeroParameters

    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"tiered.initialize(model, config): model must be a torch.nn.Module, got {type(model).__name__}"
        )
    check_not_managed(model)
    distributed = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size(process_group) if distributed else 1
    rank = dist.get_rank(process_group) if distributed else 0
    cfg = config_for_training(config, model=model, world_size=world_size, **hyperparameters)
    placement = choose_placement(cfg)
    scheduler = None
    if cfg.scheduler is not None:
        from tiered.optim.schedulers import build_scheduler

        scheduler = build_scheduler(cfg.scheduler, base_lr=cfg.optimizer.lr)
    tm = build_tier_manager(cfg, rank=rank, world_size=world_size)
    zp = None
    try:
        zp = ZeroParameters(
            model,
            tm,
            cfg,
            param_tier=placement.param_tier,
            grad_tier=placement.grad_tier,
            compute_dtype=placement.compute_dtype,
            process_group=process_group,
        )
        trainable = [g for g in zp.groups if g.trainable]  # frozen groups are never stepped
        plans = plan_optimizer_placement(
            trainable, cfg, placement.optimizer_tier, gpu_is_host=tier_is_host(tm, "gpu")
        )
        pipe = pipeline_bytes(
            trainable, plans, cfg.zero.offload_optimizer.buffer_count, placement.compute_dtype
        )
        needs = capacity_needs(zp.groups, plans, zp.gpu_need, pipeline=pipe)
        check_capacity(tm, needs)
        optimizer = OffloadedAdam(
            tm,
            trainable,
            cfg,
            zp.initial_fp32_shard,
            optimizer_tier=placement.optimizer_tier,
            compute_dtype=placement.compute_dtype,
            plans=plans,
        )
    except BaseException:
        if zp is not None:
            zp.remove_hooks()
        tm.close()
        raise
    log.info(
        "tiered engine: %d groups, params in %s, grads in %s, optimizer in %s, %s, world %d",
        len(zp.groups),
        placement.param_tier,
        placement.grad_tier,
        placement.optimizer_tier,
        placement.compute_dtype,
        world_size,
    )
    engine = Engine(
        model,
        cfg,
        tm,
        zp,
        optimizer,
        placement,
        process_group=process_group,
        world_size=world_size,
        rank=rank,
        scheduler=scheduler,
        capacity=needs,
    )
    mark_managed(model, engine)
    return engine
