"""Plain PyTorch in DeepSpeed's clothes: the reference that tests/test_deepspeed_examples.py runs
the example scripts against, by putting ``import torch_reference_deepspeed as deepspeed`` where the
port has ``import tiered.deepspeed as deepspeed`` (every other line of the script is the same).

It trains as a plain PyTorch loop would (``loss.backward()``, ``torch.nn.utils.clip_grad_norm_``,
a torch Adam/AdamW, the lr set by hand before each step) with DeepSpeed's documented semantics for
what the scripts use: backward divides by gradient_accumulation_steps, step() steps at the
boundary and then zeroes the gradients, a client optimizer wins over the config's section, the
config's "Adam" is AdamW unless adam_w_mode is false, WarmupLR's log warmup as DeepSpeed indexes
it, and the loader a DistributedSampler with seed 0. No tiered code trains here."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch
import torch.distributed as dist


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--deepspeed", default=False, action="store_true")
    parser.add_argument("--deepspeed_config", default=None, type=str)
    return parser


def init_distributed(*_: Any, **__: Any) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class _Accelerator:
    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"


def get_accelerator() -> _Accelerator:
    return _Accelerator()


def split_params_into_different_moe_groups_for_optimizer(groups: Any) -> list[dict[str, Any]]:
    return [groups] if isinstance(groups, dict) else list(groups)


def warmup_lr(cfg: dict[str, Any], applied: int) -> float:
    """WarmupLR (log warmup) for the step taken after `applied` steps: DeepSpeed steps its
    scheduler after each optimizer step from last_batch_iteration -1."""
    p = cfg["params"]
    lo, hi, w = (
        p.get("warmup_min_lr", 0.0),
        p.get("warmup_max_lr", 0.001),
        max(2, p.get("warmup_num_steps", 1000)),
    )
    i = applied - 1
    if i < 0:
        return float(lo)
    frac = math.log(i + 1) / math.log(w) if i < w else 1.0
    return float(lo + (hi - lo) * frac)


class Engine:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: dict[str, Any]) -> None:
        self.module, self.optimizer, self.cfg = model, optimizer, cfg
        self.gas = int(cfg.get("gradient_accumulation_steps", 1))
        self.clip = float(cfg.get("gradient_clipping", 0.0))
        self.local_rank, self.global_steps, self.micro_steps = 0, 0, 0
        self.device = torch.device("cpu")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.gas).backward()

    def step(self) -> None:
        self.micro_steps += 1
        if self.micro_steps % self.gas:
            return
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(
                [p for g in self.optimizer.param_groups for p in g["params"]], self.clip
            )
        sched = self.cfg.get("scheduler")
        if sched is not None:
            assert sched["type"] == "WarmupLR", sched
            for g in self.optimizer.param_groups:
                g["lr"] = warmup_lr(sched, self.global_steps)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.global_steps += 1

    def fp16_enabled(self) -> bool:
        return bool(self.cfg.get("fp16", {}).get("enabled", False))

    def bfloat16_enabled(self) -> bool:
        return bool(self.cfg.get("bf16", {}).get("enabled", False))

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def eval(self) -> None:
        self.module.eval()

    def save_checkpoint(self, save_dir: Any, tag: Any = None, client_state: Any = None) -> None:
        pass  # the reference compares losses only


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    collate_fn: Any = None,
    config: Any = None,
    **_: Any,
) -> tuple[Engine, Any, Any, Any]:
    assert model is not None and lr_scheduler is None
    if config is None:
        config = args.deepspeed_config
    cfg: dict[str, Any] = config if isinstance(config, dict) else json.loads(open(config).read())
    init_distributed()
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if optimizer is None:
        o = cfg["optimizer"]
        hp = dict(o.get("params", {}))
        adamw = o["type"].lower() == "adamw" or hp.pop("adam_w_mode", True)
        hp.pop("torch_adam", None)
        optimizer = (torch.optim.AdamW if adamw else torch.optim.Adam)(params, **hp)
        if "lr" not in hp:
            for g in optimizer.param_groups:
                g["lr"] = 1e-3
    engine = Engine(model, optimizer, cfg)
    loader = None
    if training_data is not None:
        mb = cfg.get("train_micro_batch_size_per_gpu") or cfg["train_batch_size"] // engine.gas
        sampler = torch.utils.data.DistributedSampler(
            training_data, num_replicas=1, rank=0, shuffle=True, seed=0
        )
        loader = torch.utils.data.DataLoader(
            training_data,
            batch_size=mb,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=bool(cfg.get("dataloader_drop_last", False)),
        )
    return engine, optimizer, loader, None
