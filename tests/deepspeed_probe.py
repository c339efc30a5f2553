"""The DeepSpeed calls ported scripts and libraries make, as one probe list run on any engine.

`run_probes(ds, workdir)` builds the same model over the same JSON through `ds.initialize` (``ds``
is ``tiered.deepspeed`` or DeepSpeed itself), then makes each call of `PROBES` in order and
records its (normalised) value or its error. tests/test_deepspeed_surface.py checks tiered's
values against those DeepSpeed 0.19.8's CPU engine gave (tests/data/deepspeed_probe_values.json,
written by ``python tests/deepspeed_probe.py --record`` where DeepSpeed is installed);
tests/test_deepspeed_parity.py compares the two engines live. ``python tests/deepspeed_probe.py``
prints how many calls work (the count docs/deepspeed.md reports).

A probe's kind: "value" (compared with DeepSpeed's), "runs" (it must work; its value is not
DeepSpeed's to match: file layouts, accelerator details), or "differs" (tiered deliberately
returns something else, named in docs/deepspeed.md: ``state_dict()`` under ZeRO-3 is gathered).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VALUES = Path(__file__).resolve().parent / "data" / "deepspeed_probe_values.json"

CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "zero_force_ds_cpu_optimizer": False,
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
        "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 0.01,
            "warmup_num_steps": 4,
            "warmup_type": "linear",
        },
    },
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 48)
        self.out = nn.Linear(48, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(F.gelu(self.inp(x))), y)


def dataset() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(16, generator=g), torch.randn(8, generator=g)) for _ in range(16)]


@dataclass
class Ctx:
    ds: Any
    workdir: str
    out: tuple[Any, ...] = ()
    model: Any = None
    seen: dict[str, Any] = field(default_factory=dict)

    @property
    def engine(self) -> Any:
        return self.out[0]


def norm(v: Any) -> Any:
    """A JSON value of `v`: tensors by shape and rounded sum / norm, floats rounded."""
    if isinstance(v, torch.Tensor):
        f = v.detach().double()
        return {"shape": list(v.shape), "sum": round(float(f.sum()), 5), "norm": round(float(f.norm()), 5)}
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return None if math.isnan(v) else round(v, 6)
    if isinstance(v, (list, tuple)):
        return [norm(x) for x in v]
    if isinstance(v, dict):
        return {str(k): norm(x) for k, x in v.items()}
    return type(v).__name__


def _train(c: Ctx, micro_steps: int) -> dict[str, list[Any]]:
    engine, _, loader, sched = c.out
    rec: dict[str, list[Any]] = {"loss": [], "boundary": [], "applied": [], "lr": [], "last_lr": []}
    it = iter(loader)
    for _ in range(micro_steps):
        x, y = next(it)
        rec["boundary"].append(engine.is_gradient_accumulation_boundary())
        loss = engine(x, y)
        rec["loss"].append(float(loss))
        engine.backward(loss)
        engine.step()
        rec["applied"].append(engine.was_step_applied())
        rec["lr"].append(engine.get_lr())
        rec["last_lr"].append(sched.get_last_lr())
    return rec


def _first_batch(c: Ctx) -> Any:
    x, y = next(iter(c.out[2]))
    return x


def _gathered_read(c: Ctx) -> Any:
    w = c.model.inp.weight
    with c.ds.zero.GatheredParameters(w):
        return w.detach().clone()


def _gathered_modify(c: Ctx) -> Any:
    b = c.model.out.bias
    with c.ds.zero.GatheredParameters([b], modifier_rank=0):
        with torch.no_grad():
            b.fill_(0.25)
    return c.ds.utils.safe_get_full_fp32_param(b)


def _set_fp32(c: Ctx) -> Any:
    b = c.model.inp.bias
    c.ds.utils.safe_set_full_fp32_param(b, torch.full((48,), 0.5))
    return c.ds.utils.safe_get_full_fp32_param(b)


def _set_state(c: Ctx) -> Any:
    b = c.model.inp.bias
    c.ds.utils.safe_set_full_optimizer_state(b, torch.full((48,), 0.125), "exp_avg")
    return c.ds.utils.safe_get_full_optimizer_state(b, "exp_avg")


def _grad_after_backward(c: Ctx) -> Any:
    engine = c.engine
    x, y = next(iter(c.out[2]))
    engine.backward(engine(x, y))
    g = c.ds.utils.safe_get_full_grad(c.model.inp.weight)
    engine.zero_grad()
    return g


def _save(c: Ctx, **kw: Any) -> Any:
    return c.engine.save_checkpoint(os.path.join(c.workdir, "ckpt"), **kw) is not None


def _load(c: Ctx, **kw: Any) -> Any:
    path, state = c.engine.load_checkpoint(os.path.join(c.workdir, "ckpt"), tag="t1", **kw)
    return [path is not None, state.get("epoch") if state else None]


def _load_tensor_state(c: Ctx) -> Any:
    _, state = c.engine.load_checkpoint(os.path.join(c.workdir, "ckpt"), tag="t1")
    return state["ids"]


def _save16(c: Ctx) -> Any:
    d = os.path.join(c.workdir, "w16")
    c.engine.save_16bit_model(d, "model.bin")
    sd = torch.load(os.path.join(d, "model.bin"), weights_only=True)
    return {k: v for k, v in sorted(sd.items())}


def _args(c: Ctx) -> Any:
    p = c.ds.add_config_arguments(argparse.ArgumentParser())
    a = p.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    return [a.deepspeed, a.deepspeed_config]


def _zero_init(c: Ctx) -> Any:
    with c.ds.zero.Init(config_dict_or_path=CONFIG):
        m = Net()
    e, *_ = c.ds.initialize(model=m, model_parameters=m.parameters(), config=CONFIG)
    x, y = dataset()[0]
    loss = e(x[None], y[None])
    e.backward(loss)
    e.step()
    return math.isfinite(float(loss))


def _all_reduce(c: Ctx) -> Any:
    t = torch.ones(3)
    c.ds.comm.all_reduce(t)
    return t


def _moe_split(c: Ctx) -> Any:
    groups = c.ds.moe.utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(c.model.parameters()), "name": "parameters"}
    )
    return [len(groups), [len(g["params"]) for g in groups]]


def _moe_layer(c: Ctx) -> Any:
    """DeepSpeed builds its expert-parallel layer; tiered refuses it naming the alternative."""
    try:
        c.ds.moe.layer.MoE(hidden_size=48, expert=nn.Linear(48, 48), num_experts=1, ep_size=1)
    except Exception as e:  # the refusal is the answer
        if "expert parallelism" in str(e) and "leaf module" in str(e):
            return "refused, naming leaf modules"
        raise
    return "built"


def _launcher_env(c: Ctx) -> Any:
    """What DeepSpeed's init_distributed leaves in os.environ for one process without a launcher."""
    return {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")} | {
        "MASTER_PORT set": bool(os.environ["MASTER_PORT"])
    }


def _leaf(c: Ctx) -> Any:
    c.ds.utils.set_z3_leaf_modules(Net(), [nn.Linear])
    return True


# ---- the namespaces scripts import (issue 39) ------------------------------------------------


def _resolves(c: Ctx, module: str, attr: str) -> Any:
    """``from deepspeed.X import Y`` in the probing process gives the probed API's Y."""
    import importlib

    target = c.ds
    for part in module.split(".")[1:]:
        target = getattr(target, part)
    return getattr(importlib.import_module(module), attr) is getattr(target, attr)


def _adam_step(c: Ctx, cls: str, **kw: Any) -> Any:
    """One step of DeepSpeed's Adam class from fixed weights and gradients."""
    w = nn.Parameter(torch.linspace(-1.0, 1.0, 12))
    opt = getattr(c.ds.ops.adam, cls)([w], lr=0.1, weight_decay=0.01, **kw)
    for k in range(2):
        w.grad = torch.linspace(0.5, -0.5, 12) * (k + 1)
        opt.step()
    return w.detach()


def _client_cpu_adam_training(c: Ctx) -> Any:
    torch.manual_seed(3)
    m = Net()
    opt = c.ds.ops.adam.DeepSpeedCPUAdam(m.parameters(), lr=0.01, weight_decay=0.01)
    cfg = {k: v for k, v in CONFIG.items() if k not in ("optimizer", "scheduler")}
    e, *_ = c.ds.initialize(model=m, optimizer=opt, config=cfg)
    losses = []
    for x, y in dataset()[:4]:
        loss = e(x[None], y[None])
        e.backward(loss)
        e.step()
        losses.append(float(loss))
    c.seen["cpu_adam_model"] = m
    return losses


def _schedule(c: Ctx, cls: str, steps: int = 6, **kw: Any) -> Any:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05)
    sched = getattr(c.ds.runtime.lr_schedules, cls)(opt, **kw)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs + [sched.state_dict()["last_batch_iteration"]]


def _activation_checkpoint(c: Ctx, fn: str) -> Any:
    torch.manual_seed(4)
    lin = nn.Linear(6, 6)
    x = torch.randn(3, 6, requires_grad=True)
    out = getattr(c.ds.checkpointing, fn)(lambda t: torch.tanh(lin(t)), x)
    out.sum().backward()
    return [out.detach(), lin.weight.grad, x.grad]


def _repeating(c: Ctx) -> Any:
    it = c.ds.runtime.dataloader.RepeatingLoader([1, 2, 3])
    return [next(it) for _ in range(7)]


def _broadcast(c: Ctx) -> Any:
    t = torch.arange(4.0)
    c.ds.comm.broadcast(t, 0)
    return t


def _all_gather(c: Ctx) -> Any:
    out = [torch.zeros(3)]
    c.ds.comm.all_gather(out, torch.arange(3.0))
    return out


def _all_gather_object(c: Ctx) -> Any:
    out: list[Any] = [None]
    c.ds.comm.all_gather_object(out, {"k": 1})
    return out


def _ds_attrs(c: Ctx) -> Any:
    return [[p.ds_numel, list(p.ds_shape), hasattr(p, "ds_tensor")] for p in c.model.parameters()]


def _state_dict_shapes(c: Ctx) -> Any:
    return {k: list(v.shape) for k, v in sorted(c.engine.module.state_dict().items())}


def _load_missing(c: Ctx) -> Any:
    return list(c.engine.load_checkpoint(os.path.join(c.workdir, "no-such-checkpoints")))


def _refused(c: Ctx, call: Callable[[], Any], words: str) -> Any:
    """tiered refuses what it does not implement, naming it; DeepSpeed builds it."""
    try:
        call()
    except Exception as e:  # the refusal is the answer
        if words in str(e) and "Instead:" in str(e):
            return "refused, naming the alternative"
        raise
    return "built"


Probe = tuple[str, str, Callable[[Ctx], Any]]

PROBES: list[Probe] = [
    # the 4-tuple
    ("initialize returns 4", "value", lambda c: len(c.out)),
    (
        "optimizer is a torch Optimizer (DeepSpeed's ZeRO optimizer is not)",
        "differs",
        lambda c: isinstance(c.out[1], torch.optim.Optimizer),
    ),
    ("loader has len", "value", lambda c: len(c.out[2])),
    ("loader's first batch (DeepSpeed's sampler)", "value", _first_batch),
    ("lr_scheduler is returned", "value", lambda c: c.out[3] is not None),
    ("lr_scheduler.get_last_lr()", "value", lambda c: c.out[3].get_last_lr()),
    (
        "lr_scheduler.state_dict()[last_batch_iteration]",
        "value",
        lambda c: c.out[3].state_dict()["last_batch_iteration"],
    ),
    ("engine.lr_scheduler is it", "value", lambda c: c.engine.lr_scheduler is c.out[3]),
    ("engine.training_dataloader is the loader", "value", lambda c: c.engine.training_dataloader is c.out[2]),
    # config accessors
    ("train_batch_size()", "value", lambda c: c.engine.train_batch_size()),
    ("train_micro_batch_size_per_gpu()", "value", lambda c: c.engine.train_micro_batch_size_per_gpu()),
    ("gradient_accumulation_steps()", "value", lambda c: c.engine.gradient_accumulation_steps()),
    ("fp16_enabled()", "value", lambda c: c.engine.fp16_enabled()),
    ("bfloat16_enabled()", "value", lambda c: c.engine.bfloat16_enabled()),
    ("zero_optimization_stage()", "value", lambda c: c.engine.zero_optimization_stage()),
    ("zero_optimization()", "value", lambda c: bool(c.engine.zero_optimization())),
    (
        "zero_optimization_partition_weights()",
        "value",
        lambda c: bool(c.engine.zero_optimization_partition_weights()),
    ),
    (
        "zero_offload_optimizer().device",
        "value",
        lambda c: str(getattr(d := c.engine.zero_offload_optimizer().device, "value", d)),
    ),
    (
        "zero_offload_param().device",
        "value",
        lambda c: str(getattr(d := c.engine.zero_offload_param().device, "value", d)),
    ),
    ("zero_cpu_offload()", "value", lambda c: c.engine.zero_cpu_offload()),
    ("gradient_clipping()", "value", lambda c: c.engine.gradient_clipping()),
    ("steps_per_print()", "value", lambda c: c.engine.steps_per_print()),
    ("wall_clock_breakdown()", "value", lambda c: c.engine.wall_clock_breakdown()),
    ("dump_state()", "value", lambda c: bool(c.engine.dump_state())),
    ("dynamic_loss_scale()", "value", lambda c: bool(c.engine.dynamic_loss_scale())),
    ("optimizer_name()", "value", lambda c: c.engine.optimizer_name()),
    ("scheduler_name()", "value", lambda c: c.engine.scheduler_name()),
    ("get_mom()", "value", lambda c: c.engine.get_mom()),
    ("get_lr() before training", "value", lambda c: c.engine.get_lr()),
    ("global_rank", "value", lambda c: c.engine.global_rank),
    ("local_rank", "value", lambda c: c.engine.local_rank),
    ("world_size", "value", lambda c: c.engine.world_size),
    ("global_steps", "value", lambda c: c.engine.global_steps),
    ("global_samples", "value", lambda c: c.engine.global_samples),
    ("micro_steps", "value", lambda c: c.engine.micro_steps),
    ("skipped_steps", "value", lambda c: c.engine.skipped_steps),
    ("monitor.enabled", "value", lambda c: bool(c.engine.monitor.enabled)),
    ("is_compiled", "value", lambda c: bool(c.engine.is_compiled)),
    ("was_step_applied() before training", "value", lambda c: c.engine.was_step_applied()),
    (
        "is_gradient_accumulation_boundary() at start",
        "value",
        lambda c: c.engine.is_gradient_accumulation_boundary(),
    ),
    ("get_global_grad_norm() before training", "value", lambda c: c.engine.get_global_grad_norm()),
    # the engine as a module
    ("parameters(): numel under ZeRO-3", "value", lambda c: sum(p.numel() for p in c.engine.parameters())),
    ("len(parameters())", "value", lambda c: len(list(c.engine.parameters()))),
    ("named_parameters() names", "value", lambda c: [n for n, _ in c.engine.named_parameters()]),
    ("state_dict() keys", "value", lambda c: sorted(c.engine.state_dict())),
    ("module is the model", "value", lambda c: c.engine.module is c.model),
    ("train() returns the engine (DeepSpeed's: None)", "differs", lambda c: c.engine.train() is c.engine),
    (
        "eval() then the model's training",
        "value",
        lambda c: [(c.engine.eval(), c.model.training)[1], (c.engine.train(), c.model.training)[1]],
    ),
    ("device.type", "value", lambda c: c.engine.device.type),
    ("a model attribute through the engine", "value", lambda c: type(c.engine.inp).__name__),
    ("optimizer.param_groups count", "value", lambda c: len(c.out[1].param_groups)),
    ("optimizer.param_groups lr", "value", lambda c: [g["lr"] for g in c.out[1].param_groups]),
    (
        "optimizer.state_dict() has param_groups (DeepSpeed's: its ZeRO state)",
        "differs",
        lambda c: "param_groups" in c.out[1].state_dict(),
    ),
    # training over initialize's loader: 2 accumulation windows of 2
    ("train 4 micro-steps", "value", lambda c: c.seen.setdefault("train", _train(c, 4))),
    ("global_steps after", "value", lambda c: c.engine.global_steps),
    ("global_samples after", "value", lambda c: c.engine.global_samples),
    ("micro_steps after", "value", lambda c: c.engine.micro_steps),
    ("get_global_grad_norm() after", "value", lambda c: float(c.engine.get_global_grad_norm())),
    ("was_step_applied() after", "value", lambda c: c.engine.was_step_applied()),
    ("lr_scheduler.get_last_lr() after", "value", lambda c: c.out[3].get_last_lr()),
    ("lr_scheduler.state_dict() after", "value", lambda c: c.out[3].state_dict()["last_batch_iteration"]),
    ("optimizer.param_groups lr after", "value", lambda c: [g["lr"] for g in c.out[1].param_groups]),
    ("engine.zero_grad()", "runs", lambda c: c.engine.zero_grad()),
    ("optimizer.zero_grad()", "runs", lambda c: c.out[1].zero_grad()),
    ("model.zero_grad()", "runs", lambda c: c.model.zero_grad()),
    # partitioned parameters by hand
    ("safe_get_full_fp32_param", "value", lambda c: c.ds.utils.safe_get_full_fp32_param(c.model.inp.weight)),
    (
        "safe_get_full_optimizer_state exp_avg",
        "value",
        lambda c: c.ds.utils.safe_get_full_optimizer_state(c.model.inp.weight, "exp_avg"),
    ),
    (
        "safe_get_full_optimizer_state exp_avg_sq",
        "value",
        lambda c: c.ds.utils.safe_get_full_optimizer_state(c.model.inp.weight, "exp_avg_sq"),
    ),
    (
        "safe_get_local_fp32_param numel",
        "value",
        lambda c: c.ds.utils.safe_get_local_fp32_param(c.model.inp.weight).numel(),
    ),
    # tiered's is plain PyTorch's gradient (tests/test_deepspeed_surface.py); DeepSpeed's CPU-offload
    # engine returned another value
    ("safe_get_full_grad after a backward", "differs", _grad_after_backward),
    ("GatheredParameters reads", "value", _gathered_read),
    # checkpoints
    (
        "save_checkpoint(tag, client_state)",
        "runs",
        lambda c: _save(c, tag="t1", client_state={"epoch": 3, "ids": torch.arange(3)}),
    ),
    ("load_checkpoint(tag)", "value", lambda c: _load(c)),
    ("client_state tensor comes back", "value", _load_tensor_state),
    (
        "load_checkpoint(load_optimizer_states=False, load_lr_scheduler_states=False)",
        "value",
        lambda c: _load(c, load_optimizer_states=False, load_lr_scheduler_states=False),
    ),
    ("load_checkpoint(load_module_only=True)", "value", lambda c: _load(c, load_module_only=True)),
    ("global_steps after loads", "value", lambda c: c.engine.global_steps),
    (
        "save_checkpoint(exclude_frozen_parameters=True)",
        "runs",
        lambda c: _save(c, tag="t2", exclude_frozen_parameters=True),
    ),
    ("save_16bit_model(dir, filename)", "value", _save16),
    ("get_lr() after loads", "value", lambda c: c.engine.get_lr()),
    # writes into the partitions: DeepSpeed's CPU-offload engine kept the old fp32 master after a
    # GatheredParameters write-back; tiered writes the master too ([Note: gathered parameters])
    ("GatheredParameters(modifier_rank=0) writes back", "differs", _gathered_modify),
    ("safe_set_full_fp32_param", "value", _set_fp32),
    ("safe_set_full_optimizer_state", "value", _set_state),
    ("state_dict() values (DeepSpeed's: ZeRO-3 placeholders)", "differs", lambda c: c.engine.state_dict()),
    (
        "load_state_dict(state_dict())",
        "differs",
        lambda c: c.engine.load_state_dict(c.engine.state_dict()) is not None,
    ),
    # the module-level API
    ("__version__ is a string", "value", lambda c: isinstance(c.ds.__version__, str)),
    ("add_config_arguments", "value", _args),
    ("comm.get_rank()", "value", lambda c: c.ds.comm.get_rank()),
    ("comm.get_world_size()", "value", lambda c: c.ds.comm.get_world_size()),
    ("comm.is_initialized()", "value", lambda c: c.ds.comm.is_initialized()),
    ("comm.get_local_rank()", "value", lambda c: c.ds.comm.get_local_rank()),
    ("comm.barrier()", "runs", lambda c: c.ds.comm.barrier()),
    ("comm.all_reduce", "value", _all_reduce),
    ("torch.distributed.get_rank() after initialize", "value", lambda c: torch.distributed.get_rank()),
    ("init_distributed() again", "runs", lambda c: c.ds.init_distributed()),
    (
        "accelerator.get_accelerator().device_name()",
        "value",
        lambda c: c.ds.accelerator.get_accelerator().device_name(),
    ),
    (
        "get_accelerator().is_available()",
        "value",
        lambda c: c.ds.accelerator.get_accelerator().is_available(),
    ),
    ("get_accelerator().device_count()", "runs", lambda c: c.ds.accelerator.get_accelerator().device_count()),
    (
        "get_accelerator().communication_backend_name()",
        "runs",
        lambda c: c.ds.accelerator.get_accelerator().communication_backend_name(),
    ),
    ("get_accelerator().manual_seed(0)", "runs", lambda c: c.ds.accelerator.get_accelerator().manual_seed(0)),
    ("utils.set_z3_leaf_modules", "runs", _leaf),
    ("zero.Init(config_dict_or_path=) then initialize and train", "value", _zero_init),
    # one process, and DeepSpeedExamples' CIFAR script; "runs" until values are recorded on DeepSpeed
    ("RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT in os.environ after initialize", "runs", _launcher_env),
    ("moe.utils.split_params_into_different_moe_groups_for_optimizer (no experts)", "runs", _moe_split),
    # tiered has no expert parallelism ([Note: MoE without expert parallelism])
    ("moe.layer.MoE(...)", "differs", _moe_layer),
    # ---- the namespaces scripts import (issue 39) -----------------------------------------
    ("from deepspeed import comm", "value", lambda c: _resolves(c, "deepspeed", "comm")),
    (
        "import deepspeed.comm as dist: get_rank",
        "value",
        lambda c: _resolves(c, "deepspeed.comm", "get_rank"),
    ),
    (
        "from deepspeed.accelerator import get_accelerator",
        "value",
        lambda c: _resolves(c, "deepspeed.accelerator", "get_accelerator"),
    ),
    (
        "from deepspeed.ops.adam import DeepSpeedCPUAdam",
        "value",
        lambda c: _resolves(c, "deepspeed.ops.adam", "DeepSpeedCPUAdam"),
    ),
    (
        "from deepspeed.ops.adam import FusedAdam",
        "value",
        lambda c: _resolves(c, "deepspeed.ops.adam", "FusedAdam"),
    ),
    (
        "from deepspeed.runtime.lr_schedules import WarmupLR",
        "value",
        lambda c: _resolves(c, "deepspeed.runtime.lr_schedules", "WarmupLR"),
    ),
    (
        "from deepspeed.runtime.engine import DeepSpeedEngine",
        "value",
        lambda c: _resolves(c, "deepspeed.runtime.engine", "DeepSpeedEngine"),
    ),
    (
        "from deepspeed.utils import safe_get_full_fp32_param",
        "value",
        lambda c: _resolves(c, "deepspeed.utils", "safe_get_full_fp32_param"),
    ),
    (
        "from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer",
        "value",
        lambda c: _resolves(c, "deepspeed.moe.utils", "split_params_into_different_moe_groups_for_optimizer"),
    ),
    (
        "isinstance(engine, DeepSpeedEngine)",
        "value",
        lambda c: isinstance(c.engine, c.ds.runtime.engine.DeepSpeedEngine),
    ),
    (
        "deepspeed.DeepSpeedEngine",
        "value",
        lambda c: c.ds.DeepSpeedEngine is c.ds.runtime.engine.DeepSpeedEngine,
    ),
    ("ops.adam.DeepSpeedCPUAdam: 2 steps", "value", lambda c: _adam_step(c, "DeepSpeedCPUAdam")),
    (
        "ops.adam.DeepSpeedCPUAdam(adamw_mode=False): 2 steps",
        "value",
        lambda c: _adam_step(c, "DeepSpeedCPUAdam", adamw_mode=False),
    ),
    ("initialize(optimizer=DeepSpeedCPUAdam) trains", "value", _client_cpu_adam_training),
    (
        "ops.adam.FusedAdam(...) builds",
        "runs",
        lambda c: type(c.ds.ops.adam.FusedAdam([nn.Parameter(torch.zeros(2))])).__name__,
    ),
    (
        "runtime.lr_schedules.WarmupLR",
        "value",
        lambda c: _schedule(c, "WarmupLR", warmup_max_lr=0.05, warmup_num_steps=4),
    ),
    (
        "runtime.lr_schedules.WarmupLR linear",
        "value",
        lambda c: _schedule(c, "WarmupLR", warmup_min_lr=0.01, warmup_num_steps=3, warmup_type="linear"),
    ),
    (
        "runtime.lr_schedules.WarmupDecayLR",
        "value",
        lambda c: _schedule(c, "WarmupDecayLR", total_num_steps=5, warmup_max_lr=0.05, warmup_num_steps=2),
    ),
    (
        "runtime.lr_schedules.WarmupCosineLR",
        "value",
        lambda c: _schedule(c, "WarmupCosineLR", total_num_steps=5, warmup_num_steps=2),
    ),
    (
        "runtime.zero.partition_parameters.ZeroParamStatus",
        "value",
        lambda c: [s.name for s in c.ds.runtime.zero.partition_parameters.ZeroParamStatus],
    ),
    (
        "runtime.zero.GatheredParameters is zero.GatheredParameters",
        "value",
        lambda c: c.ds.runtime.zero.GatheredParameters is c.ds.zero.GatheredParameters,
    ),
    ("checkpointing.checkpoint", "value", lambda c: _activation_checkpoint(c, "checkpoint")),
    (
        "checkpointing.non_reentrant_checkpoint",
        "value",
        lambda c: _activation_checkpoint(c, "non_reentrant_checkpoint"),
    ),
    ("checkpointing.configure(None)", "runs", lambda c: c.ds.checkpointing.configure(None)),
    ("checkpointing.is_configured()", "value", lambda c: c.ds.checkpointing.is_configured()),
    (
        "runtime.utils.see_memory_usage",
        "runs",
        lambda c: c.ds.runtime.utils.see_memory_usage("probe", force=True),
    ),
    ("runtime.dataloader.RepeatingLoader", "value", _repeating),
    (
        "runtime.compiler.is_compile_supported()",
        "value",
        lambda c: c.ds.runtime.compiler.is_compile_supported(),
    ),
    ("utils.log_dist", "runs", lambda c: c.ds.utils.log_dist("probe", ranks=[0])),
    ("utils.logger.info", "runs", lambda c: c.ds.utils.logger.info("probe")),
    ("comm.broadcast", "value", _broadcast),
    ("comm.all_gather", "value", _all_gather),
    ("comm.all_gather_object", "value", _all_gather_object),
    ("comm.get_all_ranks_from_group()", "value", lambda c: c.ds.comm.get_all_ranks_from_group(None)),
    ("comm.get_world_group()", "runs", lambda c: c.ds.comm.get_world_group() is not None),
    (
        "accelerator.current_device_name()",
        "value",
        lambda c: c.ds.accelerator.get_accelerator().current_device_name(),
    ),
    (
        "accelerator.is_bf16_supported()",
        "runs",
        lambda c: c.ds.accelerator.get_accelerator().is_bf16_supported(),
    ),
    ("accelerator.synchronize()", "runs", lambda c: c.ds.accelerator.get_accelerator().synchronize()),
    ("accelerator.empty_cache()", "runs", lambda c: c.ds.accelerator.get_accelerator().empty_cache()),
    (
        "accelerator.memory_allocated()",
        "runs",
        lambda c: c.ds.accelerator.get_accelerator().memory_allocated(),
    ),
    ("accelerator.total_memory()", "runs", lambda c: c.ds.accelerator.get_accelerator().total_memory()),
    (
        "accelerator.manual_seed_all(0)",
        "runs",
        lambda c: c.ds.accelerator.get_accelerator().manual_seed_all(0),
    ),
    ("ds_numel, ds_shape, ds_tensor of partitioned parameters", "value", _ds_attrs),
    ("module.state_dict() under ZeRO-3: placeholders", "value", _state_dict_shapes),
    ("load_checkpoint(a folder without latest)", "value", _load_missing),
    # tiered has no inference engine nor pipeline parallelism ([Note: refused DeepSpeed features])
    (
        "init_inference(model)",
        "differs",
        lambda c: _refused(
            c, lambda: c.ds.init_inference(nn.Linear(4, 4), dtype=torch.float32), "DeepSpeed-Inference"
        ),
    ),
    (
        "pipe.PipelineModule(layers, num_stages=1)",
        "differs",
        lambda c: _refused(
            c, lambda: c.ds.pipe.PipelineModule(layers=[nn.Linear(4, 4)], num_stages=1), "pipeline"
        ),
    ),
]


def run_probes(ds: Any, workdir: str) -> dict[str, dict[str, Any]]:
    """Each probe's {"ok", "value" | "error"}, in order (see the module doc)."""
    torch.manual_seed(0)
    c = Ctx(ds, workdir)
    c.model = Net()
    results: dict[str, dict[str, Any]] = {}
    try:
        c.out = tuple(
            ds.initialize(
                model=c.model, model_parameters=c.model.parameters(), training_data=dataset(), config=CONFIG
            )
        )
    except Exception as e:  # noqa: BLE001 - a probe records, never stops
        return {name: {"ok": False, "error": f"initialize: {e!r}"} for name, _, _ in PROBES}
    for name, _kind, fn in PROBES:
        try:
            results[name] = {"ok": True, "value": norm(fn(c))}
        except Exception as e:  # noqa: BLE001
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
    return results


def kind_of(name: str) -> str:
    return next(k for n, k, _ in PROBES if n == name)


def _deepspeed() -> Any:
    """DeepSpeed itself on its CPU accelerator, in a one-rank world from the environment (its
    init_distributed would look for MPI otherwise)."""
    import socket

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(port))
    import deepspeed
    import deepspeed.accelerator
    import deepspeed.comm
    import deepspeed.moe.layer
    import deepspeed.moe.utils
    import deepspeed.ops.adam
    import deepspeed.runtime.compiler
    import deepspeed.runtime.dataloader
    import deepspeed.runtime.lr_schedules
    import deepspeed.runtime.utils
    import deepspeed.runtime.zero.partition_parameters
    import deepspeed.utils

    return deepspeed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--deepspeed", action="store_true", help="probe DeepSpeed itself")
    p.add_argument("--record", action="store_true", help=f"probe DeepSpeed and write {VALUES.name}")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if a.deepspeed or a.record:
        ds = _deepspeed()
    else:
        import tiered.deepspeed as ds
    with tempfile.TemporaryDirectory() as d:
        res = run_probes(ds, d)
    ok = sum(r["ok"] for r in res.values())
    for name, r in res.items():
        if not r["ok"]:
            print(f"FAIL {name}: {r['error']}")
    print(f"{ok} of {len(res)} calls work")
    if a.record:
        VALUES.write_text(json.dumps({"deepspeed": ds.__version__, "results": res}, indent=1) + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
