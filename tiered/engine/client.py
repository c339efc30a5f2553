"""What `initialize` does with DeepSpeed's keywords: model_parameters, a client optimizer and lr
scheduler, training_data. See [Note: param groups as per-parameter hyper-parameters] and
[Note: the optimizer facade]."""

from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tiered.config.schema import TieredConfig
from tiered.engine.facade import ClientLR, TieredOptimizer
from tiered.engine.param_groups import client_optimizer_groups, param_hyper_of, resolve_model_parameters
from tiered.errors import ConfigError, UnsupportedConfigError
from tiered.optim.hyper import ParamHyper

if TYPE_CHECKING:
    from tiered.engine.engine import Engine


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
    config to load."""
    opt = req.optimizer
    if opt is not None and not isinstance(opt, torch.optim.Optimizer) and callable(opt):
        params = req.model_parameters if req.model_parameters is not None else model.parameters()
        opt = req.optimizer = opt(params)  # DeepSpeed's optimizer factory: callable(params)
    needs_raw = opt is not None or req.lr_scheduler is not None
    raw = _raw_config(config) if needs_raw else None
    if opt is not None:
        assert raw is not None
        if raw.get("optimizer") is not None:
            raise ConfigError(
                f"both a client optimizer ({type(opt).__name__}) and an optimizer section in the config: "
                "remove one (Hugging Face's integration passes one or the other)"
            )
        resolved = client_optimizer_groups(model, opt)
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
    if req.lr_scheduler is not None and raw is not None and raw.get("scheduler") is not None:
        raise ConfigError(
            f"both a client lr_scheduler ({type(req.lr_scheduler).__name__}) and a scheduler section in the "
            "config: remove one (the engine would step both)"
        )
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


def finish(
    engine: Engine, model: torch.nn.Module, req: ClientRequest, scales: list[float]
) -> tuple[Any, ...]:
    """Give the engine its facade and client scheduler; DeepSpeed's 4-tuple."""
    assert req.groups is not None
    cfg = engine.config
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
    facade.attach(engine)
    engine.facade = facade
    engine._lr_scales = tuple(scales)
    sched = req.lr_scheduler
    if sched is not None and not hasattr(sched, "step") and callable(sched):
        sched = sched(facade)  # DeepSpeed's scheduler factory: callable(optimizer)
    if sched is not None:
        source = getattr(sched, "optimizer", None)
        if source is not facade and (req.optimizer is None or source is not req.optimizer):
            raise ConfigError(
                f"lr_scheduler {type(sched).__name__} drives an optimizer that is neither the client optimizer "
                "passed to initialize nor the one it returns; build it on one of those"
            )
        engine.lr_scheduler = sched
        engine.scheduler = ClientLR(source.param_groups, scales)
    elif cfg.scheduler is None:
        # a scheduler the script builds on the returned optimizer later drives the lr through it
        engine.scheduler = ClientLR(facade.param_groups, scales)
    loader = None
    if req.training_data is not None:
        loader = _dataloader(engine, req.training_data, req.collate_fn)
    return engine, facade, loader, sched


def _dataloader(engine: Engine, data: Any, collate_fn: Any) -> torch.utils.data.DataLoader[Any]:
    """DeepSpeed's `deepspeed_io`: micro-batches of train_micro_batch_size_per_gpu, a
    DistributedSampler over the data-parallel ranks (a RandomSampler on one)."""
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

    micro = engine.config.train_micro_batch_size_per_gpu
    if micro is None:
        raise ConfigError(
            "training_data was given but the config has no train_micro_batch_size_per_gpu (nor "
            "train_batch_size): set it, or pass micro_batch_size=, to size the data loader's batches"
        )
    sampler: Sampler[Any]
    if engine.world_size > 1:
        sampler = DistributedSampler(data, num_replicas=engine.world_size, rank=engine.rank)
    else:
        sampler = RandomSampler(data)
    return DataLoader(data, batch_size=micro, sampler=sampler, collate_fn=collate_fn)
