"""Building an engine: its run (the resolved config and this process's place among the ranks),
its tiers and placement, every other part (`EngineParts`), then the `Engine` over them.

`initialize` is the whole of it for ``tiered.initialize(model, config)``; tiered.deepspeed's
initialize calls the same steps with what DeepSpeed's keywords add between them (a client
optimizer's config section, per-parameter hyper-parameters, an lr source, `EngineHooks`). Each
part exists before the engine's constructor: nothing is attached to an engine afterwards.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tiered.config.loader import config_for_training, read_config_file
from tiered.config.schema import TieredConfig
from tiered.engine import signals
from tiered.engine.capacity import check_capacity, preflight
from tiered.engine.distributed import ensure_process_group
from tiered.engine.engine import Engine
from tiered.engine.host_memory import fix_mmap_threshold
from tiered.engine.lifetime import check_not_managed, mark_managed
from tiered.engine.parts import EngineHooks, EngineParts
from tiered.engine.residency import keep_resident, plan_engine_residency
from tiered.errors import CapacityError, ConfigError, DistributedSetupError
from tiered.optim.arrivals import grads_consumed_from_memory
from tiered.optim.offload import OffloadedAdam
from tiered.optim.placement import gpu_stepped_grad_tier, plan_optimizer_placement, tier_is_host
from tiered.optim.schedulers import ConstantLR, LRSchedule, build_scheduler
from tiered.planning.homes import Placement
from tiered.planning.homes import choose_placement as _choose_placement
from tiered.planning.needs import engine_needs, host_extra, is_peft_model, tier_memory
from tiered.planning.traffic import bytes_per_step, masters_prefetch_groups
from tiered.units import format_bytes
from tiered.zero import ZeroParameters

if TYPE_CHECKING:
    from tiered.optim.hyper import ParamHyper
    from tiered.storage.base import StorageBackend
    from tiered.tiers import Tier, TierManager

__all__ = [
    "Config",
    "ClientInputs",
    "Placement",
    "Run",
    "build_parts",
    "build_tier_manager",
    "check_model",
    "check_process_group",
    "choose_placement",
    "initialize",
    "open_engine",
    "resolve_run",
    "tier_order",
]

log = logging.getLogger(__name__)

Config = dict[str, Any] | str | os.PathLike[str] | TieredConfig


def initialize(
    model: torch.nn.Module,
    config: Config,
    *,
    process_group: Any = None,
    weights: str | os.PathLike[str] | None = None,
    init_missing: bool = False,
    **hyperparameters: Any,
) -> Engine:
    """Partition `model` into shard groups over the configured tiers and return the Engine.

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

    DeepSpeed's keywords (model_parameters=, optimizer=, lr_scheduler=, training_data=) are
    ``tiered.initialize``'s and tiered.deepspeed's, which build through this module.
    """
    check_model(model)
    check_process_group(process_group)
    run = resolve_run(model, config, process_group, **hyperparameters)
    return open_engine(build_parts(model, run, weights=weights, init_missing=init_missing))


def check_model(model: torch.nn.Module) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"tiered.initialize(model, config): model must be a torch.nn.Module, got {type(model).__name__}"
        )
    check_not_managed(model)


def check_process_group(process_group: Any) -> None:
    """Under torchrun a process group exists before anything is built ([Note: process group from
    torchrun]): never one replica per process."""
    if process_group is None:
        ensure_process_group()
    distributed = dist.is_available() and dist.is_initialized()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not distributed:
        raise DistributedSetupError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} (a torchrun launch) but torch.distributed is not "
            "initialised: every process would train its own replica. Call "
            "torch.distributed.init_process_group() before tiered.initialize (tiered.deepspeed.initialize "
            "does it for you, as DeepSpeed does)"
        )


@dataclass(frozen=True)
class Run:
    """What one engine trains with: the resolved config and this process's data-parallel group."""

    config: TieredConfig
    process_group: Any
    world_size: int
    rank: int


def resolve_run(model: torch.nn.Module, config: Config, process_group: Any, **hyperparameters: Any) -> Run:
    """The model checked, the config read and resolved for it ("auto" values, [Note: auto
    config], `hyperparameters`), before anything is built."""
    distributed = dist.is_available() and dist.is_initialized()
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
        config = read_config_file(config)
    from tiered.config.auto_request import has_auto_config
    from tiered.planning.auto import resolve_auto_config

    if has_auto_config(config):  # [Note: auto config]
        assert isinstance(config, dict)
        config = resolve_auto_config(config, model, world_size=world_size)
    cfg = config_for_training(config, model=model, world_size=world_size, **hyperparameters)
    _check_state_format(cfg)
    return Run(cfg, process_group, world_size, rank)


def _check_state_format(cfg: TieredConfig) -> None:
    """tiered.optimizer_state_format against the optimizer, before anything is built (an unknown
    name, or a compressed format with a non-Adam optimizer, refused by name; [Note: compressed
    optimizer state])."""
    from tiered.optim.state_format import state_format

    state_format(cfg.tiered.optimizer_state_format, optimizer=cfg.optimizer.type)


@dataclass(frozen=True)
class ClientInputs:
    """What a caller driving the optimizer from outside adds to the parts (tiered.deepspeed's
    client optimizer, param groups and scheduler); the defaults are ``tiered.initialize``'s."""

    param_hyper: Mapping[str, ParamHyper] | None = None
    """Per-parameter hyper-parameters where a param group differs ([Note: param groups as
    per-parameter hyper-parameters])."""
    lr_scales: tuple[float, ...] = (1.0,)
    lr_source: LRSchedule | None = None
    """Drives the lr instead of the config's scheduler section."""
    hooks: EngineHooks | None = None


def build_parts(
    model: torch.nn.Module,
    run: Run,
    *,
    weights: str | os.PathLike[str] | None = None,
    init_missing: bool = False,
    client: ClientInputs | None = None,
) -> EngineParts:
    """Tiers, the ZeRO-3 partitions, the optimizer and every check, for `run`: the engine's parts
    (a failure closes what was opened)."""
    client = client if client is not None else ClientInputs()
    cfg, world_size, rank = run.config, run.world_size, run.rank
    load_plan = None
    if weights is not None:  # names, shapes and coverage, before any tier exists
        from tiered.zero.load import WeightSource

        load_plan = WeightSource(weights).plan(model, init_missing=init_missing)
    elif init_missing:
        raise ConfigError("tiered.initialize: init_missing=True needs weights=<model folder>")
    placement = choose_placement(cfg)
    schedule: LRSchedule
    if client.lr_source is not None:
        schedule = client.lr_source
    elif cfg.scheduler is not None:
        schedule = build_scheduler(cfg.scheduler, base_lr=cfg.optimizer.lr)
    else:
        schedule = ConstantLR(cfg.optimizer.lr)
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
            process_group=run.process_group,
            weights=load_plan,
            gpu_stepped_grad_tier=gpu_stepped_grad_tier(
                cfg, placement.grad_tier, not tm.tier(placement.grad_tier).backend.capabilities.memory_like
            ),
        )
        trainable = [g for g in zp.groups if g.trainable]  # frozen groups are never stepped
        gpu_is_host = tier_is_host(tm, "gpu")
        plans = plan_optimizer_placement(trainable, cfg, placement.optimizer_tier, gpu_is_host=gpu_is_host)
        needs = engine_needs(zp.groups, plans, zp.gpu_need, cfg, placement.compute_dtype)
        check_capacity(tm, needs)
        memory = {t: tier_memory(cfg, t, gpu_is_host=gpu_is_host) for t in tm.tier_names}
        host = host_extra(  # [Note: one memory model]: what stats()["host_memory"] reports
            zp.groups,
            plans,
            cfg,
            device_kind="cpu" if gpu_is_host else "cuda",
            compute_dtype=placement.compute_dtype,
            peft=is_peft_model(model),
            needs=needs,
            memory=memory,
            world_size=world_size,
        )
        # param_hyper only when a group differs: [Note: param groups as per-parameter hyper-parameters]
        extra: dict[str, Any] = (
            {} if client.param_hyper is None else {"param_hyper": dict(client.param_hyper)}
        )
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
    return EngineParts(
        module=model,
        config=cfg,
        tm=tm,
        zero=zp,
        optimizer=optimizer,
        placement=placement,
        process_group=run.process_group,
        world_size=world_size,
        rank=rank,
        scheduler=schedule,
        config_schedule=client.lr_source is None and cfg.scheduler is not None,
        lr_scales=client.lr_scales,
        capacity=needs,
        host_memory=host,
        traffic_floor=floor,
        tier_memory=memory,
        residency=residency,
        # its tokenizer files go into engine.save_pretrained's export
        tokenizer_source=None if weights is None else os.fspath(weights),
        hooks=client.hooks,
    )


def open_engine(parts: EngineParts) -> Engine:
    """The engine over `parts`, marked as its module's manager and closed by SIGTERM."""
    engine = Engine(parts)
    mark_managed(parts.module, engine)
    signals.watch(engine)  # [Note: SIGTERM from a library]
    return engine


_ORDER = ("gpu", "cpu", "nvme")


def choose_placement(cfg: TieredConfig) -> Placement:
    """Where the engine puts each kind of state (`tiered.planning.homes.choose_placement`), logged."""
    placement = _choose_placement(cfg)
    log.info("tiers used: %s", placement.describe(cfg))
    return placement


def tier_order(names: Sequence[str]) -> list[str]:
    """Fastest first: gpu, cpu, nvme, then custom tiers in the order given."""
    known = [n for n in _ORDER if n in names]
    return known + [n for n in names if n not in _ORDER]


def check_trace_path(path: str | os.PathLike[str], what: str = "tiered.trace_path") -> None:
    """The trace is written at close, after the whole run: a path it cannot be written to is
    refused now, naming `what` (the key or flag that gave it)."""
    target = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise ConfigError(
            f"{what} = {os.fspath(path)!r}: folder {parent} does not exist; create it or choose another path "
            "(the trace is written when the engine closes)"
        )
    if os.path.isdir(target):
        raise ConfigError(f"{what} = {os.fspath(path)!r} is a folder; name a file in it, e.g. trace.json")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} = {os.fspath(path)!r}: folder {parent} is not writable by this user")


def build_tier_manager(cfg: TieredConfig, *, rank: int = 0, world_size: int = 1) -> TierManager:
    """Open every configured backend (entry points only: tiered never imports plugins/) and
    hand them, with their budgets, to one TierManager.

    With several ranks, a backend spec with a "path" gets a per-rank subdirectory
    (``<path>/rank<r>``): every rank names its partitions alike, so one shared nvme_path
    (the usual DeepSpeed config) must not make ranks overwrite each other's files. Swap
    backends (the derived offload tiers) need none: each process has its own swap folder."""
    from tiered.tiers import TierManager
    from tiered.tiers.io_policy import IOPolicy

    if cfg.tiered.trace_path is not None:
        check_trace_path(cfg.tiered.trace_path)
    specs = dict(cfg.tiered.tiers)
    for name in ("gpu", "cpu"):
        if name not in specs:
            raise ConfigError(f"tiered.tiers.{name} is missing: the engine needs a {name!r} tier")
    tiers: list[Tier] = []
    try:
        for name in tier_order(list(specs)):
            tiers.append(
                _open_tier(
                    name, specs[name], rank=rank, world_size=world_size, timeout_s=cfg.tiered.timeout_s
                )
            )
    except BaseException:
        # a later tier that fails (an unknown backend, a budget too big) must not leave the
        # swap folders of the tiers already opened behind
        _close_backends([(t.name, t.backend) for t in tiers], cfg.tiered.timeout_s)
        raise
    t = cfg.tiered
    policy = IOPolicy(
        timeout_s=t.timeout_s,
        floor_s=t.io_timeout_floor_s,
        min_bytes_per_s=t.io_min_bytes_per_s,
        retries=t.io_retries,
        backoff_s=t.io_retry_backoff_s,
        transient=t.io_retry_errno_codes,
    )
    return TierManager(
        tiers,
        timeout_s=t.timeout_s,
        io_threads=t.io_threads,
        record_trace=t.trace_path is not None,
        verify=t.verify_checksums,
        io_policy=policy,
    )


def _open_tier(name: str, spec: Any, *, rank: int, world_size: int, timeout_s: float) -> Tier:
    from tiered.storage import open_backend
    from tiered.tiers import Tier

    bspec = dict(spec.backend)
    # a swap backend already writes into a private per-process folder that close() removes;
    # a rank subfolder would only be left behind, empty
    per_rank = world_size > 1 and isinstance(bspec.get("path"), str) and not bspec.get("swap")
    if per_rank:
        bspec["path"] = os.path.join(bspec["path"], f"rank{rank}")
    try:
        if per_rank:
            os.makedirs(bspec["path"], mode=0o700, exist_ok=True)
        backend = open_backend(bspec)
    except (OSError, PermissionError) as e:
        path = spec.backend.get("path")
        raise ConfigError(
            f"tiered.tiers.{name}: cannot open backend {spec.backend.get('type')!r}"
            + (f" at {path!r}" if path else "")
            + f": {e}; point nvme_path at a writable directory"
        ) from e
    budget = spec.budget_bytes
    try:
        total = backend.capacity().total_bytes if budget is not None else None
    except Exception:  # noqa: BLE001 - a backend that cannot tell its size: nothing to compare
        total = None
    if budget is not None and total is not None and budget > total:
        _close_backends([(name, backend)], timeout_s)
        raise CapacityError(
            f"tiered.tiers.{name}.budget {format_bytes(budget, binary=True)} ({budget} bytes) is more than "
            f"backend {backend.name!r} has in all: {format_bytes(total, binary=True)} ({total} bytes); "
            "lower the budget, or leave it out to use what the backend reports free"
        )
    return Tier(name=name, backend=backend, budget_bytes=budget)


def _close_backends(backends: Sequence[tuple[str, StorageBackend]], timeout_s: float) -> None:
    """Close backends from synchronous code, on a thread with its own loop (the caller may run
    inside one), all at once and each within `timeout_s` ([Note: bounded close]); errors are
    logged, never raised over the error being reported."""
    import asyncio
    import threading

    from tiered.tiers.waiting import close_all

    async def close_them() -> None:
        try:
            await close_all(backends, timeout_s)
        except Exception as e:  # noqa: BLE001 - the set-up error is the one to report
            log.warning("after a failed set-up: %s", e)

    t = threading.Thread(target=lambda: asyncio.run(close_them()), name="tiered-setup-close", daemon=True)
    t.start()
    t.join(timeout=1.05 * timeout_s + 0.5)  # close_all bounds itself; this only covers a blocked loop
