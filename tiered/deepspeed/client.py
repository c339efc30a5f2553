"""What `initialize` does with DeepSpeed's keywords: model_parameters, a client optimizer and lr
scheduler, training_data. Everything here is built before the engine and handed to its parts as
one `ClientSide` (its `EngineHooks`: nothing is written into an engine afterwards). See [Note:
param groups as per-parameter hyper-parameters] and [Note: the optimizer facade]."""

from __future__ import annotations

import copy
import inspect
import logging
import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader

from tiered.config.schema import TieredConfig
from tiered.deepspeed.engine_api import DeepSpeedEngine
from tiered.deepspeed.facade import ClientLR, TieredOptimizer
from tiered.deepspeed.param_groups import client_optimizer_groups, param_hyper_of, resolve_model_parameters
from tiered.engine.build import (
    ClientInputs,
    Config,
    build_parts,
    check_model,
    check_process_group,
    open_engine,
    resolve_run,
)
from tiered.engine.zero_grad import shadow
from tiered.errors import ConfigError, UnsupportedConfigError
from tiered.optim.hyper import ParamHyper

log = logging.getLogger(__name__)

DEEPSPEED_SAMPLER_SEED = 0
"""The seed of the DistributedSampler DeepSpeed's loader uses (torch's default): equal batch order."""


@dataclass
class ClientRequest:
    """DeepSpeed's keywords as given, and what `prepare` made of them."""

    model_parameters: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    training_data: Any = None
    collate_fn: Any = None
    groups: list[dict[str, Any]] | None = None

    @property
    def given(self) -> bool:
        return any(
            x is not None
            for x in (self.model_parameters, self.optimizer, self.lr_scheduler, self.training_data)
        )


@dataclass(frozen=True)
class ClientSide:
    """What the engine gets of a DeepSpeed-style call, in its parts: the optimizer facade, each
    param group's lr scale, the client's lr scheduler (stepped after every applied step) and the
    lr source it drives (None: the config's schedule drives), and initialize's data loader. It is
    the engine's `EngineHooks` (tiered/engine/parts.py)."""

    facade: TieredOptimizer
    lr_scales: tuple[float, ...]
    lr_scheduler: Any = None
    lr_source: ClientLR | None = None
    training_dataloader: DataLoader[Any] | None = None
    client_optimizer: Any = None
    """The optimizer the script passed (its zero_grad and step now reach the engine: [Note:
    zero_grad of the model]), None without one."""
    _undo: list[Callable[[], None]] = field(default_factory=list, init=False, repr=False)
    """Restores the client optimizer's own zero_grad and step at close."""

    @property
    def optimizer_name(self) -> str | None:
        """The client optimizer's class name (DeepSpeed's `optimizer_name()`), None without one."""
        return None if self.client_optimizer is None else type(self.client_optimizer).__name__

    # ---- lr plumbing ([Note: the optimizer facade]) ------------------------------------------
    def after_applied_step(self, next_lrs: list[float]) -> None:
        """A client scheduler steps (as DeepSpeed's engine steps it); otherwise the facade's
        groups show the lrs the config's schedule gives the next step."""
        if self.lr_scheduler is not None:
            with warnings.catch_warnings():
                # torch warns that the client optimizer never stepped, or that its step was replaced
                # ([Note: zero_grad of the model]): the engine stepped instead
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*optimizer.step")
                warnings.filterwarnings("ignore", message=".*optimizer.step.*overridden")
                self.lr_scheduler.step()
        else:
            self.show_lrs(next_lrs)

    def show_lrs(self, lrs: list[float]) -> None:
        """The facade's groups hold `lrs` (the config schedule's, for the next step), as
        DeepSpeed's scheduler writes its optimizer's groups; a client scheduler writes its own."""
        if self.lr_scheduler is None:
            for g, lr in zip(self.facade.param_groups, lrs, strict=True):
                g["lr"] = lr

    def redirect_client_optimizer(self) -> None:
        """The client optimizer's zero_grad and step are the facade's while the engine is open
        ([Note: zero_grad of the model])."""
        if self.client_optimizer is None:
            return
        ref = weakref.ref(self.facade)

        def zero_grad(set_to_none: bool = True) -> None:
            facade = ref()
            if facade is not None:
                facade.zero_grad(set_to_none)

        def step(closure: Any = None) -> None:
            facade = ref()
            if facade is not None:
                facade.step(closure)

        shadow(self.client_optimizer, "zero_grad", zero_grad, self._undo)
        shadow(self.client_optimizer, "step", step, self._undo)

    def closed(self) -> None:
        while self._undo:
            self._undo.pop()()

    def training_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "state_dict"):
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        state["param_group_lrs"] = [float(g["lr"]) for g in self.facade.param_groups]
        return state

    def apply_training_state(self, state: dict[str, Any], *, lr_scheduler: bool = True) -> None:
        """Restore a checkpoint's client scheduler and facade lrs (`lr_scheduler=False`: keep them,
        DeepSpeed's ``load_lr_scheduler_states=False``)."""
        if not lr_scheduler:
            return
        if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            groups = self.lr_scheduler.optimizer.param_groups
            for g, lr in zip(groups, self.lr_scheduler.get_last_lr(), strict=True):
                g["lr"] = lr
        if state.get("param_group_lrs") is not None:
            for g, lr in zip(self.facade.param_groups, state["param_group_lrs"], strict=True):
                g["lr"] = lr


def _raw_config(config: Any) -> dict[str, Any]:
    from tiered.config.dump import dump_config
    from tiered.config.loader import read_config_file

    if isinstance(config, TieredConfig):
        return dump_config(config)
    if isinstance(config, (str, os.PathLike)):
        return read_config_file(config)
    if isinstance(config, dict):
        return copy.deepcopy(config)
    raise ConfigError(
        f"initialize: config must be a dict, a JSON path or a TieredConfig, got {type(config).__name__}"
    )


def prepare(model: torch.nn.Module, config: Any, req: ClientRequest) -> Any:
    """Resolve the groups; a client optimizer becomes the config's optimizer section. Returns the
    config to load. As DeepSpeed documents it, a client optimizer overrides the config's
    ``optimizer`` section and a client lr scheduler its ``scheduler`` section (each logged)."""
    opt = req.optimizer
    if opt is not None and not isinstance(opt, torch.optim.Optimizer) and callable(opt):
        params = req.model_parameters if req.model_parameters is not None else model.parameters()
        opt = req.optimizer = opt(params)  # DeepSpeed's optimizer factory: callable(params)
    needs_raw = opt is not None or req.lr_scheduler is not None
    raw = _raw_config(config) if needs_raw else None
    if opt is not None:
        assert raw is not None
        resolved = client_optimizer_groups(model, opt)
        if raw.get("optimizer") is not None:
            log.warning(
                "both a client optimizer (%s) and an optimizer section in the config: the client optimizer "
                "is used, as DeepSpeed does (its initialize: the optimizer argument overrides the config's); "
                "the section %s is not",
                type(opt).__name__,
                raw["optimizer"],
            )
        if req.model_parameters is not None and req.optimizer is not None:
            # the optimizer's own groups are the truth; model_parameters must be the same tensors
            resolve_model_parameters(model, req.model_parameters)
        raw["optimizer"] = resolved.optimizer_section
        req.groups = resolved.groups
        config = raw
    elif req.model_parameters is not None:
        req.groups = resolve_model_parameters(model, req.model_parameters)
    else:
        req.groups = [{"names": [n for n, p in model.named_parameters() if p.requires_grad]}]
    if req.lr_scheduler is not None:
        assert raw is not None
        if raw.get("scheduler") is not None:
            log.warning(
                "both a client lr_scheduler (%s) and a scheduler section in the config: the client scheduler "
                "drives the lr, as DeepSpeed does; the section %s is not used",
                type(req.lr_scheduler).__name__,
                raw.pop("scheduler"),
            )
        config = raw
    return config


def param_hyper(cfg: TieredConfig, req: ClientRequest) -> tuple[dict[str, ParamHyper] | None, list[float]]:
    """The per-parameter hyper-parameters to pass to the offloaded Adam (None: all default)."""
    assert req.groups is not None
    o = cfg.optimizer
    hyper, scales = param_hyper_of(
        req.groups, lr=o.lr, weight_decay=o.weight_decay, betas=(o.betas[0], o.betas[1]), eps=o.eps
    )
    if hyper is not None and not offloaded_adam_takes_param_hyper():
        raise UnsupportedConfigError(
            "the param groups set their own weight_decay or lr, but this build's offloaded Adam takes one "
            "value for every parameter (no param_hyper); use one group, or a tiered with per-group "
            "hyper-parameters"
        )
    return hyper, scales


def offloaded_adam_takes_param_hyper() -> bool:
    from tiered.optim.offload import OffloadedAdam

    return "param_hyper" in inspect.signature(OffloadedAdam.__init__).parameters


def client_side(
    cfg: TieredConfig,
    model: torch.nn.Module,
    req: ClientRequest,
    scales: list[float],
    *,
    world_size: int,
    rank: int,
) -> ClientSide:
    """The facade, the client scheduler and the loader, for the engine's constructor."""
    assert req.groups is not None
    by_name = dict(model.named_parameters())
    base = cfg.optimizer.lr
    groups = []
    for g, s in zip(req.groups, scales, strict=True):
        groups.append(
            {
                "params": [by_name[n] for n in g["names"]],
                "lr": base * s,
                "weight_decay": float(g.get("weight_decay", cfg.optimizer.weight_decay)),
            }
        )
    defaults = {
        "lr": base,
        "betas": tuple(cfg.optimizer.betas),
        "eps": cfg.optimizer.eps,
        "weight_decay": cfg.optimizer.weight_decay,
    }
    facade = TieredOptimizer(groups, defaults)
    sched = req.lr_scheduler
    if sched is not None and not hasattr(sched, "step") and callable(sched):
        sched = sched(facade)  # DeepSpeed's scheduler factory: callable(optimizer)
    source: ClientLR | None = None
    if sched is not None:
        driven = getattr(sched, "optimizer", None)
        if driven is not facade and (req.optimizer is None or driven is not req.optimizer):
            raise ConfigError(
                f"lr_scheduler {type(sched).__name__} drives an optimizer that is neither the client optimizer "
                "passed to initialize nor the one it returns; build it on one of those"
            )
        assert driven is not None
        source = ClientLR(driven.param_groups, scales)
    elif cfg.scheduler is None:
        # a scheduler the script builds on the returned optimizer later drives the lr through it
        source = ClientLR(facade.param_groups, scales)
    loader = None
    if req.training_data is not None:
        loader = dataloader(cfg, req.training_data, req.collate_fn, world_size=world_size, rank=rank)
    return ClientSide(facade, tuple(scales), sched, source, loader, req.optimizer)


def dataloader(
    cfg: TieredConfig, data: Any, collate_fn: Any, *, world_size: int, rank: int
) -> DataLoader[Any]:
    """DeepSpeed's `deepspeed_io`: micro-batches of train_micro_batch_size_per_gpu drawn by a
    `DistributedSampler` over the data-parallel ranks with its default seed, on one process too
    (DeepSpeed's loader does so whenever LOCAL_RANK is set, which its init_distributed ensures):
    the same batches in the same order as DeepSpeed's. No `set_epoch`: as DeepSpeed's, every pass
    over the data repeats the first epoch's order. `dataloader_drop_last` is DeepSpeed's: the
    DataLoader's `drop_last` (the sampler pads to equal shards across ranks either way)."""
    from torch.utils.data import DistributedSampler

    micro = cfg.train_micro_batch_size_per_gpu
    if micro is None:
        raise ConfigError(
            "training_data was given but the config has no train_micro_batch_size_per_gpu (nor "
            "train_batch_size): set it, or pass micro_batch_size=, to size the data loader's batches"
        )
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=world_size, rank=rank, seed=DEEPSPEED_SAMPLER_SEED
    )
    return DataLoader(
        data, batch_size=micro, sampler=sampler, collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last
    )


class InitializeResult(NamedTuple):
    """DeepSpeed's ``(engine, optimizer, training_dataloader, lr_scheduler)``, typed."""

    engine: DeepSpeedEngine
    optimizer: TieredOptimizer
    training_dataloader: DataLoader[Any] | None
    lr_scheduler: Any
    """The client's scheduler, else the config section's (`ConfigLRScheduler`), else None."""


def initialize_with_client(
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
) -> InitializeResult:
    """``tiered.initialize`` with DeepSpeed's keywords (`model_parameters`: parameters or
    param-group dicts; `optimizer`: a client torch Adam/AdamW or DeepSpeed Adam, translated to
    tiered's offloaded Adam; `lr_scheduler`: a client scheduler driving the lr; `training_data`):
    DeepSpeed's ``(engine, optimizer, dataloader, lr_scheduler)`` over a `DeepSpeedEngine`
    ([Note: the optimizer facade]). The rest as `tiered.engine.initialize`, whose steps it runs
    with the client's parts between them."""
    check_model(model)
    check_process_group(process_group)
    req = ClientRequest(model_parameters, optimizer, lr_scheduler, training_data, collate_fn)
    config = prepare(model, config, req)
    run = resolve_run(model, config, process_group, **hyperparameters)
    hyper, lr_scales = param_hyper(run.config, req)
    side = client_side(run.config, model, req, lr_scales, world_size=run.world_size, rank=run.rank)
    inputs = ClientInputs(param_hyper=hyper, lr_scales=side.lr_scales, lr_source=side.lr_source, hooks=side)
    engine = open_engine(build_parts(model, run, weights=weights, init_missing=init_missing, client=inputs))
    side.redirect_client_optimizer()  # [Note: zero_grad of the model]
    side.facade.attach(engine)
    side.show_lrs(engine.get_lr())  # the first step's, as DeepSpeed's scheduler sets at its start
    adapter = DeepSpeedEngine(engine, side)
    return InitializeResult(adapter, side.facade, side.training_dataloader, adapter.lr_scheduler)
