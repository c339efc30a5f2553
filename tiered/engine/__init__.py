"""`tiered.initialize(model, config) -> Engine`: config, tiers, ZeRO-3 partitions, offloaded Adam."""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple, overload

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tiered.config.loader import config_for_training
from tiered.config.schema import TieredConfig
from tiered.engine import client, signals
from tiered.engine.build import (
    Placement,
    build_tier_manager,
    check_budgets,
    check_capacity,
    check_not_managed,
    choose_placement,
    engine_needs,
    mark_managed,
)
from tiered.engine.distributed import ensure_process_group
from tiered.engine.engine import Engine
from tiered.engine.facade import TieredOptimizer
from tiered.engine.host_memory import fix_mmap_threshold
from tiered.engine.residency import keep_resident, plan_engine_residency
from tiered.errors import CapacityError, ConfigError, DistributedSetupError
from tiered.optim.arrivals import grads_consumed_from_memory
from tiered.optim.offload import OffloadedAdam
from tiered.optim.placement import gpu_stepped_grad_tier, plan_optimizer_placement, tier_is_host
from tiered.optim.schedulers import build_scheduler
from tiered.planning.needs import host_extra, is_peft_model, tier_memory
from tiered.planning.traffic import bytes_per_step, masters_prefetch_groups
from tiered.zero import ZeroParameters

log = logging.getLogger(__name__)

__all__ = ["Engine", "InitializeResult", "Placement", "from_pretrained", "initialize"]


Config = dict[str, Any] | str | os.PathLike[str] | TieredConfig


class InitializeResult(NamedTuple):
    """DeepSpeed's ``(engine, optimizer, training_dataloader, lr_scheduler)``, typed."""

    engine: Engine
    optimizer: TieredOptimizer
    training_dataloader: DataLoader[Any] | None
    lr_scheduler: Any
    """The client's scheduler, else the config section's (`ConfigLRScheduler`), else None."""


@overload
def initialize(
    model: torch.nn.Module,
    config: Config,
    *,
    process_group: Any = None,
    model_parameters: None = None,
    optimizer: None = None,
    lr_scheduler: None = None,
    training_data: None = None,
    collate_fn: Any = None,
    weights: str | os.PathLike[str] | None = None,
    init_missing: bool = False,
    **hyperparameters: Any,
) -> Engine: ...


@overload
def initialize(
    model: torch.nn.Module,
    config: Config,
    *,
    process_group: Any = None,
    model_parameters: Any = None,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    training_data: Any = None,
    collate_fn: Any = None,
    weights: str | os.PathLike[str] | None = None,
    init_missing: bool = False,
    **hyperparameters: Any,
) -> Engine | InitializeResult: ...


def initialize(
    model: torch.nn.Module,
    config: Config,
    *,
    process_group: Any = None,
    model_parameters: Any = None,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    training_data: Any = None,
    collate_fn: Any = None,
    weights: str | os.PathLike[str] | None = None,
    init_missing: bool = False,
    **hyperparameters: Any,
) -> Engine | InitializeResult:
    """Partition `model` into shard groups over the configured tiers and return the Engine.

    With any of DeepSpeed's keywords (`model_parameters`: parameters or param-group dicts;
    `optimizer`: a client torch Adam/AdamW or DeepSpeed Adam, translated to tiered's offloaded
    Adam; `lr_scheduler`: a client scheduler driving the lr; `training_data`) it returns
    DeepSpeed's ``(engine, optimizer, dataloader, lr_scheduler)`` instead, an `InitializeResult`
    (see tiered.deepspeed.initialize, [Note: the optimizer facade]).

    `config` is tiered's JSON or an unchanged DeepSpeed JSON (dict or path), or a resolved
    TieredConfig. Under torch.distributed (torchrun) the data-parallel group is the default
    group unless `process_group` is given; with WORLD_SIZE > 1 in the environment and no group,
    the default group is set up from torchrun's variables (see [Note: process group from
    torchrun]). Every budget is checked before training starts
    (see [Note: capacity check before training]). `hyperparameters` (lr=, betas=, eps=,
    weight_decay=, warmup_steps=, total_steps=, micro_batch_size=, gradient_accumulation_steps=,
    max_grad_norm=, mixed_precision=) fill the config's "auto" as Hugging Face's Trainer does; a
    hyper-parameter neither gives is a ConfigError (see tiered.config.hyper).

    `weights`: a Hugging Face model folder whose safetensors shards are streamed into the
    partitions instead of the model's own values (build `model` on the meta device so it is never
    on the host); `init_missing=True` initialises parameters the files do not cover instead of
    refusing. See [Note: streaming load] and `tiered.from_pretrained`.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"tiered.initialize(model, config): model must be a torch.nn.Module, got {type(model).__name__}"
        )
    check_not_managed(model)
    if process_group is None:
        ensure_process_group()  # [Note: process group from torchrun]
    distributed = dist.is_available() and dist.is_initialized()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not distributed:
        raise DistributedSetupError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} (a torchrun launch) but torch.distributed is not "
            "initialised: every process would train its own replica. Call "
            "torch.distributed.init_process_group() before tiered.initialize (tiered.deepspeed.initialize "
            "does it for you, as DeepSpeed does)"
        )
    req = client.ClientRequest(model_parameters, optimizer, lr_scheduler, training_data, collate_fn)
    engine, side = _build(
        model, config, req, process_group, weights=weights, init_missing=init_missing, **hyperparameters
    )
    if side is None:
        return engine
    return InitializeResult(engine, side.facade, side.training_dataloader, engine.lr_scheduler)


def _build(
    model: torch.nn.Module,
    config: Config,
    req: client.ClientRequest,
    process_group: Any,
    *,
    weights: str | os.PathLike[str] | None,
    init_missing: bool,
    **hyperparameters: Any,
) -> tuple[Engine, client.ClientSide | None]:
    """The engine, built whole: every piece (the client side too) exists before its constructor."""
    distributed = dist.is_available() and dist.is_initialized()
    if req.given:
        config = client.prepare(model, config, req)
    world_size = dist.get_world_size(process_group) if distributed else 1
    rank = dist.get_rank(process_group) if distributed else 0
    if not any(True for _ in model.parameters()):
        raise ConfigError(
            f"tiered.initialize: {type(model).__name__} has no parameters; there is nothing to train "
            "(pass the model whose weights should learn)"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            f"tiered.initialize: every parameter of {type(model).__name__} is frozen (requires_grad=False); "
            "there is nothing to train: unfreeze some parameters (or add LoRA adapters)"
        )
    if not isinstance(config, (dict, TieredConfig)):  # a path: read here, so auto_config can be resolved
        from tiered.config.loader import read_config_file

        config = read_config_file(config)
    from tiered.config.auto_request import has_auto_config
    from tiered.planning.auto import resolve_auto_config

    if has_auto_config(config):  # [Note: auto config]
        assert isinstance(config, dict)
        config = resolve_auto_config(config, model, world_size=world_size)
    cfg = config_for_training(config, model=model, world_size=world_size, **hyperparameters)
    _check_state_format(cfg)
    hyper, lr_scales = client.param_hyper(cfg, req) if req.given else (None, [1.0])
    side = (
        client.client_side(cfg, model, req, lr_scales, world_size=world_size, rank=rank)
        if req.given
        else None
    )
    load_plan = None
    if weights is not None:  # names, shapes and coverage, before any tier exists
        from tiered.zero.load import WeightSource

        load_plan = WeightSource(weights).plan(model, init_missing=init_missing)
    elif init_missing:
        raise ConfigError("tiered.initialize: init_missing=True needs weights=<model folder>")
    placement = choose_placement(cfg)
    scheduler = None
    if cfg.scheduler is not None and (side is None or side.lr_source is None):
        scheduler = build_scheduler(cfg.scheduler, base_lr=cfg.optimizer.lr)
    fix_mmap_threshold(cfg.tiered.host_mmap_threshold)  # [Note: host allocations and glibc's heap]
    tm = build_tier_manager(cfg, rank=rank, world_size=world_size)
    zp = None
    try:
        preflight(model, cfg, tm, world_size=world_size)  # every budget shortfall at once, before any write
        zp = ZeroParameters(
            model,
            tm,
            cfg,
            param_tier=placement.param_tier,
            grad_tier=placement.grad_tier,
            compute_dtype=placement.compute_dtype,
            process_group=process_group,
            weights=load_plan,
            gpu_stepped_grad_tier=gpu_stepped_grad_tier(
                cfg, placement.grad_tier, not tm.tier(placement.grad_tier).backend.capabilities.memory_like
            ),
        )
        trainable = [g for g in zp.groups if g.trainable]  # frozen groups are never stepped
        plans = plan_optimizer_placement(
            trainable, cfg, placement.optimizer_tier, gpu_is_host=tier_is_host(tm, "gpu")
        )
        needs = engine_needs(zp.groups, plans, zp.gpu_need, cfg, placement.compute_dtype)
        check_capacity(tm, needs)
        memory = {t: tier_memory(cfg, t, gpu_is_host=tier_is_host(tm, "gpu")) for t in tm.tier_names}
        host = host_extra(  # [Note: one memory model]: what stats()["host_memory"] reports
            zp.groups,
            plans,
            cfg,
            device_kind="cpu" if tier_is_host(tm, "gpu") else "cuda",
            compute_dtype=placement.compute_dtype,
            peft=is_peft_model(model),
            needs=needs,
            memory=memory,
            world_size=world_size,
        )
        # param_hyper only when a group differs: [Note: param groups as per-parameter hyper-parameters]
        extra: dict[str, Any] = {} if hyper is None else {"param_hyper": hyper}
        optimizer = OffloadedAdam(
            tm,
            trainable,
            cfg,
            zp.initial_fp32_shard,
            optimizer_tier=placement.optimizer_tier,
            compute_dtype=placement.compute_dtype,
            plans=plans,
            **extra,
            grads_received=zp,
        )
        # [Note: residency]: what the faster tiers keep across steps, now that every partition exists
        residency = plan_engine_residency(
            tm,
            zp.groups,
            plans,
            cfg,
            {t: int(d["total"]) for t, d in needs.items()},
            memory,
            world_size=world_size,
        )
        keep_resident(tm, residency, mode=cfg.tiered.residency)
        floor = bytes_per_step(  # [Note: bytes per step]
            zp.groups,
            plans,
            memory,
            compute_dtype=placement.compute_dtype,
            accumulation=cfg.gradient_accumulation_steps,
            residency=residency,
            state_format=cfg.tiered.optimizer_state_format,
            grads_from_memory=grads_consumed_from_memory(cfg),
            max_live_numel=cfg.zero.max_live_parameters_numel,
            max_reuse_numel=cfg.zero.max_reuse_distance_numel,
            master_prefetch_groups=masters_prefetch_groups(cfg, len(plans)),
        )
    except BaseException:
        if zp is not None:
            zp.remove_hooks()
        try:
            tm.close()
        except Exception as e:  # noqa: BLE001 - the set-up error is the one to report
            log.warning("closing the tiers after a failed set-up: %s", e)
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
        host_memory=host,
        client=side,
        # its tokenizer files go into engine.save_pretrained's export
        tokenizer_source=None if weights is None else os.fspath(weights),
        traffic_floor=floor,
        tier_memory=memory,
        residency=residency,
    )
    if side is not None:
        side.facade.attach(engine)
        side.show_lrs(engine.get_lr())  # the first step's, as DeepSpeed's scheduler sets at its start
    mark_managed(model, engine)
    signals.watch(engine)  # [Note: SIGTERM from a library]
    return engine, side


def _check_state_format(cfg: TieredConfig) -> None:
    """tiered.optimizer_state_format against the optimizer, before anything is built (an unknown
    name, or a compressed format with a non-Adam optimizer, refused by name; [Note: compressed
    optimizer state])."""
    from tiered.optim.state_format import state_format

    state_format(cfg.tiered.optimizer_state_format, optimizer=cfg.optimizer.type)


def preflight(model: torch.nn.Module, cfg: TieredConfig, tm: Any, *, world_size: int) -> None:
    """The capacity check from the module tree, before any partition is written: every tier
    short at once, then a config that fits the same budgets ([Note: one memory model],
    [Note: config search])."""
    from tiered.optim.placement import tier_is_host
    from tiered.planning.needs import live_budget_shortfall, predict

    gpu_is_host = tier_is_host(tm, "gpu")
    try:
        pred = predict(model, cfg, world_size=world_size, gpu_is_host=gpu_is_host)
    except (ConfigError, CapacityError):
        return  # ZeroParameters raises the same, with its own words
    gpu_budget = tm.tier("gpu").budget_bytes if "gpu" in tm.tier_names else None
    # [Note: the live budget searched]: the gathered bytes the plan's GPU peak counts
    live = live_budget_shortfall(pred, cfg.zero.max_live_parameters_numel, world_size, gpu_budget)
    try:
        check_budgets(tm, pred.needs, more=[live] if live else [])
    except CapacityError as exc:
        raise CapacityError(f"{exc}. {_fitting_config(model, cfg, tm, world_size, pred)}") from None


def _fitting_config(model: torch.nn.Module, cfg: TieredConfig, tm: Any, world_size: int, pred: Any) -> str:
    """The planner's fastest config within the budgets given, as JSON text, or what it lacks."""
    import json

    from tiered.optim.placement import tier_is_host
    from tiered.planning.candidate import plan_base
    from tiered.planning.search import Memories, search, shortfall_text

    def budget(name: str) -> int | None:
        return tm.tier(name).budget_bytes if name in tm.tier_names else None

    cpu = budget("cpu")
    mem = Memories(
        gpu=budget("gpu"),
        cpu=None if cpu is None else cpu + pred.host_extra_bytes,
        nvme=budget("nvme"),
    )
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(cfg.precision.dtype, "fp32")
    result = search(
        model,
        mem,
        base=plan_base(precision, cfg.gradient_accumulation_steps),
        nvme_path=cfg.zero.offload_optimizer.nvme_path or cfg.zero.offload_param.nvme_path,
        world_size=world_size,
        device_kind="cpu" if tier_is_host(tm, "gpu") else "cuda",
    )
    if result.best is None:
        near = result.closest
        return "No config fits these budgets" + (
            f"; the closest is short: {shortfall_text(near)}" if near else ""
        )
    z = result.best.config["zero_optimization"]
    t = result.best.config["tiered"]
    return "A config that fits these budgets (tiered plan's choice): " + json.dumps(
        {"zero_optimization": z, "tiered": t}
    )


from tiered.engine.pretrained import from_pretrained  # noqa: E402 - it calls initialize, defined above
