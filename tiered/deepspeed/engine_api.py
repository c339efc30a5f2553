"""DeepSpeed's engine API for ported scripts: `DeepSpeedEngine`, an adapter around tiered's
`Engine` (`tiered.deepspeed.client.initialize_with_client` builds it).

Each method keeps DeepSpeed's meaning (deepspeed/runtime/engine.py); where tiered differs it
says so. The adapter reads only the engine's public state (its config, module, counters and
partitions) and holds what DeepSpeed's keywords made (`ClientSide`); the lr plumbing of client
optimizers and schedulers is [Note: the optimizer facade].

[Note: the engine as a module]
DeepSpeed's engine is an ``nn.Module`` wrapping the model as its submodule ``module``: its
``parameters()`` are the model's, its ``named_parameters()`` and ``state_dict()`` keys carry the
``module.`` prefix, and an attribute the engine lacks is looked up on the model. tiered's engine
is not an ``nn.Module`` (it must not be registered into another module, moved with ``.to`` or
wrapped by DDP), but answers those calls the same way. Under ZeRO-3 a parameter's ``.data`` is
an empty placeholder outside forward in both engines, so ``state_dict()`` gathers: it returns
every parameter's full value in the compute dtype (on the CPU) and the module's buffers, which is
what a script that saves ``engine.state_dict()`` wants (DeepSpeed's ZeRO-3 engine hands back the
empty placeholders); ``load_state_dict`` writes such a dict back into every tier and the fp32
master ([Note: gathered parameters]).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tiered.deepspeed.facade import ConfigLRScheduler
from tiered.engine import Engine
from tiered.errors import UnsupportedConfigError

if TYPE_CHECKING:
    from tiered.config.schema import OptimizerOffloadConfig, ParamOffloadConfig, TieredConfig
    from tiered.planning.homes import Placement
    from tiered.zero import ZeroParameters

_PREFIX = "module."


class Monitor:
    """DeepSpeed's ``engine.monitor`` (its MonitorMaster): tiered's config refuses the monitor
    sections (tensorboard, wandb, csv_monitor, comet), so none is enabled and `write_events`
    writes nothing, as DeepSpeed's does with none enabled."""

    enabled = False

    def write_events(self, event_list: list[tuple[str, Any, int]]) -> None:
        return None


class ClientView(Protocol):
    """What the adapter reads of DeepSpeed's keywords as initialize made them
    (`tiered.deepspeed.client.ClientSide`)."""

    @property
    def lr_scheduler(self) -> Any: ...

    @property
    def training_dataloader(self) -> Any: ...

    @property
    def lr_scales(self) -> tuple[float, ...]: ...

    @property
    def optimizer_name(self) -> str | None: ...


class DeepSpeedEngine:
    """DeepSpeed's engine over tiered's: the training loop and checkpoints are the `Engine`'s
    (`engine`), the rest of DeepSpeed's engine API is here, and an attribute neither has is the
    model's ([Note: the engine as a module])."""

    monitor: Monitor = Monitor()

    def __init__(self, engine: Engine, client: ClientView) -> None:
        self.engine = engine
        self.client = client
        """DeepSpeed's keywords made into the facade, client scheduler and loader."""
        cfg = engine.config
        self.lr_scheduler: Any = (
            client.lr_scheduler
            if client.lr_scheduler is not None
            else ConfigLRScheduler(cfg.scheduler.type, engine.get_lr, lambda: engine.optimizer.step_count)
            if cfg.scheduler is not None
            else None
        )
        """DeepSpeed's ``engine.lr_scheduler``: the client's, else a view of the config's schedule."""

    # ---- the engine's training loop and checkpoints ------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        self.engine.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def was_step_applied(self) -> bool:
        return self.engine.was_step_applied()

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        return self.engine.save_checkpoint(
            save_dir, tag, client_state, save_latest, exclude_frozen_parameters
        )

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str, Any]:
        return self.engine.load_checkpoint(
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
            custom_load_fn,
        )

    def save_pretrained(
        self,
        save_directory: str | os.PathLike[str],
        dtype: torch.dtype = torch.bfloat16,
        max_shard_size: int | str = "5GB",
        tokenizer: Any = None,
    ) -> str:
        return self.engine.save_pretrained(save_directory, dtype, max_shard_size, tokenizer)

    def gathered_parameters(
        self, params_or_module: Any, modify: bool = False
    ) -> AbstractContextManager[None]:
        cm: AbstractContextManager[None] = self.engine.gathered_parameters(params_or_module, modify)
        return cm

    def close(self, restore_weights: bool = True) -> None:
        self.engine.close(restore_weights)

    def __enter__(self) -> DeepSpeedEngine:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.engine.__exit__(exc_type, *exc)

    # ---- the engine's state, as DeepSpeed names it ---------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def config(self) -> TieredConfig:
        return self.engine.config

    @property
    def placement(self) -> Placement:
        return self.engine.placement

    @property
    def zero(self) -> ZeroParameters:
        return self.engine.zero

    @property
    def gas(self) -> int:
        return self.engine.gas

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @property
    def micro_steps(self) -> int:
        return self.engine.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        """The module's train mode (dropout on), as ``nn.Module.train``; returns the engine."""
        self.module.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        self.module.eval()
        return self

    @property
    def training(self) -> bool:
        return self.module.training

    @property
    def device(self) -> torch.device:
        """Where the model computes (DeepSpeed: this rank's accelerator device)."""
        return self.zero.device

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (torchrun's LOCAL_RANK; 0 for one process)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        """This process's rank in the data-parallel group (one group: the global rank)."""
        return self.engine.rank

    @property
    def global_samples(self) -> int:
        """Samples consumed: train_batch_size per accumulation boundary (skipped fp16 steps
        included), as DeepSpeed counts them."""
        return self.global_steps * self.train_batch_size()

    @property
    def training_dataloader(self) -> Any:
        """The loader initialize built from `training_data` (None without one)."""
        return self.client.training_dataloader

    @property
    def is_compiled(self) -> bool:
        """tiered never compiles the engine (DeepSpeed: True after ``engine.compile()``)."""
        return False

    def compile(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedConfigError(
            "engine.compile(): tiered's engine runs the module eagerly (its ZeRO-3 hooks gather around each "
            "module); torch.compile a submodule inside it yourself if you need to"
        )

    # ---- the config, as DeepSpeed's accessors report it -------------------------------------------
    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def train_batch_size(self) -> int:
        """train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size (DeepSpeed
        derives the one not given from the others; so does tiered's config)."""
        tbs = self.config.train_batch_size
        if tbs is not None:
            return int(tbs)
        micro = self.config.train_micro_batch_size_per_gpu
        if micro is None:
            raise UnsupportedConfigError(
                "train_batch_size(): the config gives neither train_batch_size nor "
                "train_micro_batch_size_per_gpu (tiered trains without them; DeepSpeed requires one)"
            )
        return int(micro) * self.gas * self.world_size

    def train_micro_batch_size_per_gpu(self) -> int:
        micro = self.config.train_micro_batch_size_per_gpu
        if micro is not None:
            return int(micro)
        return self.train_batch_size() // (self.gas * self.world_size)

    def fp16_enabled(self) -> bool:
        return self.config.precision.dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.config.precision.dtype == torch.bfloat16

    def dynamic_loss_scale(self) -> bool:
        """DeepSpeed's meaning: fp16's ``loss_scale`` is 0 (dynamic), whether fp16 is on or not."""
        return float(self.config.precision.loss_scale) == 0.0

    def zero_optimization_stage(self) -> int:
        return int(self.config.zero.stage)

    def zero_optimization(self) -> bool:
        """DeepSpeed's meaning: ZeRO is on (stage > 0)."""
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def zero_offload_optimizer(self) -> OptimizerOffloadConfig | None:
        """The ``offload_optimizer`` section (its ``device``, ``nvme_path``, ...), None where the
        optimizer state is not offloaded."""
        off = self.config.zero.offload_optimizer
        return None if off.device == "none" else off

    def zero_offload_param(self) -> ParamOffloadConfig | None:
        off = self.config.zero.offload_param
        return None if off.device == "none" else off

    def zero_cpu_offload(self) -> bool:
        return self.config.zero.offload_optimizer.device == "cpu"

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping)

    def steps_per_print(self) -> int:
        return int(self.config.steps_per_print)

    def wall_clock_breakdown(self) -> bool:
        return bool(self.config.wall_clock_breakdown)

    def dataloader_drop_last(self) -> bool:
        return bool(self.config.dataloader_drop_last)

    def dump_state(self) -> bool:
        """Always False: tiered's config refuses ``dump_state`` (the engine logs its placement)."""
        return False

    def optimizer_name(self) -> str:
        """The client optimizer's class name, else the config's optimizer type (lower case, as
        DeepSpeed's config reports it)."""
        if self.client.optimizer_name is not None:
            return self.client.optimizer_name
        return self.config.optimizer.type.lower()

    def scheduler_name(self) -> str | None:
        return None if self.config.scheduler is None else self.config.scheduler.type

    def get_mom(self) -> list[tuple[float, float]]:
        """Adam's betas of each param group (DeepSpeed: ``betas`` for Adam-like optimizers)."""
        betas = (float(self.config.optimizer.betas[0]), float(self.config.optimizer.betas[1]))
        groups = len(self.client.lr_scales)
        return [betas] * groups

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping (inf after an fp16
        overflow). None before the first step, and where nothing needed it: tiered computes
        the norm only for gradient_clipping > 0 or fp16 (DeepSpeed always does)."""
        norm = self.engine.last_grad_norm
        return None if norm is None or norm != norm else norm

    # ---- exports ---------------------------------------------------------------------------------
    def save_16bit_model(
        self,
        save_dir: str | os.PathLike[str],
        save_filename: str | None = None,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """The consolidated weights. With `save_filename` (DeepSpeed's ``pytorch_model.bin``) one
        file ``<save_dir>/<save_filename>`` as DeepSpeed writes it: the state dict in the compute
        dtype (fp32 for an fp32 run, as DeepSpeed's), a ``torch.save`` of tensors only (it loads
        with ``torch.load(..., weights_only=True)``), or safetensors for a name ending
        ``.safetensors``. Without one, a Hugging Face directory (`save_pretrained`) in the compute
        dtype when it is 16-bit, else bf16. Every rank calls it; rank 0 writes. Returns the path."""
        dt = self.placement.compute_dtype
        dtype = dt if dt in (torch.float16, torch.bfloat16) else torch.bfloat16
        if save_filename is None:
            if exclude_frozen_parameters:
                raise UnsupportedConfigError(
                    "save_16bit_model(dir, exclude_frozen_parameters=True) without a save_filename: the "
                    "Hugging Face directory holds the whole model; pass save_filename (e.g. 'pytorch_model.bin')"
                )
            return self.save_pretrained(save_dir, dtype=dtype)
        # DeepSpeed's file holds the model's own dtype (fp32 for an fp32 run), gathered
        sd = {n: t.clone() for n, t in self.module_state_dict(exclude_frozen_parameters).items()}
        path = os.path.join(os.fspath(save_dir), save_filename)
        if self.engine.rank == 0:
            os.makedirs(os.fspath(save_dir), exist_ok=True)
            if save_filename.endswith(".safetensors"):
                from safetensors.torch import save_file

                save_file(sd, path)
            else:
                torch.save(sd, path)
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()
        return path

    def save_fp16_model(self, save_dir: str | os.PathLike[str], save_filename: str | None = None) -> str:
        """DeepSpeed's old name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    # ---- the engine as a module: [Note: the engine as a module] ------------------------------------
    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters(
            prefix=prefix + "module" if not prefix else f"{prefix}.module",
            recurse=recurse,
            remove_duplicate=remove_duplicate,
        )

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.module.buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix=f"{prefix}.module" if prefix else "module", recurse=recurse)

    def module_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The model's state dict with every parameter gathered (compute dtype, on the CPU) and its
        buffers; `exclude_frozen_parameters` leaves out those with requires_grad=False."""
        params = self.zero.gather_full_state_dict()
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
        out: dict[str, torch.Tensor] = {}
        for n, t in self.module.state_dict(keep_vars=True).items():
            if n in params:
                if not (exclude_frozen_parameters and n in frozen):
                    out[n] = params[n]
            elif isinstance(t, torch.Tensor):
                out[n] = t.detach().to("cpu", copy=True)
        return out

    def state_dict(
        self, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """``module.``-prefixed, gathered: see [Note: the engine as a module]."""
        if keep_vars:
            raise UnsupportedConfigError(
                "engine.state_dict(keep_vars=True): under ZeRO-3 the parameters are empty placeholders; "
                "state_dict() returns gathered copies, use engine.gathered_parameters(...) to hold them"
            )
        out = destination if destination is not None else {}
        for n, t in self.module_state_dict().items():
            out[f"{prefix}{_PREFIX}{n}"] = t
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Write a state dict (``module.``-prefixed as `state_dict` gives it, or the model's own
        names) into the partitions, the fp32 master and the buffers. Every rank calls it; rank
        0's values are written ([Note: gathered parameters]). Returns torch's missing/unexpected
        keys; `strict` raises on either, as ``nn.Module.load_state_dict``."""
        sd = {(k[len(_PREFIX) :] if k.startswith(_PREFIX) else k): v for k, v in state_dict.items()}
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        missing = [n for n in list(params) + list(buffers) if n not in sd]
        unexpected = [k for k in sd if k not in params and k not in buffers]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"engine.load_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}; "
                "pass strict=False to load the rest"
            )
        todo = [p for n, p in params.items() if n in sd]
        with torch.no_grad():
            with self.gathered_parameters(todo, modify=True):
                for n, p in params.items():
                    if n in sd:
                        p.data.copy_(sd[n].to(p.dtype).reshape(p.shape))
            for n, b in buffers.items():
                if n in sd:
                    b.copy_(sd[n])
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    if not TYPE_CHECKING:  # (mypy would take every misspelt attribute for the model's)

        def __getattr__(self, name: str) -> Any:
            """An attribute the adapter lacks is the engine's, else the model's, as on DeepSpeed's
            engine (public names only: neither's private state falls through)."""
            if name.startswith("_"):
                raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
            engine = self.__dict__.get("engine")
            if engine is not None:
                for owner in (engine, engine.module):
                    try:
                        return getattr(owner, name)
                    except AttributeError:
                        pass
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
