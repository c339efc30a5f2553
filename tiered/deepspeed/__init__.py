"""DeepSpeed's module API for ported scripts: ``import tiered.deepspeed as deepspeed``.

    import tiered.deepspeed as deepspeed
    engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
        model=model, model_parameters=groups, config="ds_config.json")

`initialize` (its engine is a `DeepSpeedEngine`, DeepSpeed's engine API as an adapter around
tiered's `Engine`), `init_distributed`, `add_config_arguments`, `zero` (``Init``,
``GatheredParameters``), `comm`, `utils` (the safe getters and setters), `accelerator`
(``get_accelerator``), `moe` (the group splitter; ``MoE`` refused), `ops` (``ops.adam``'s
``DeepSpeedCPUAdam`` and ``FusedAdam``), `runtime` (``DeepSpeedEngine``, the lr schedules,
``zero``), `checkpointing` (activation checkpointing), none of which needs DeepSpeed installed.
Importing this module makes ``deepspeed`` and every ``deepspeed.*`` import tiered's in the process
([Note: deepspeed as an alias of tiered.deepspeed]); `tiered run script.py` runs a DeepSpeed script
that way with no line changed. Pipeline and tensor parallelism and DeepSpeed-Inference raise
`UnsupportedFeatureError` where a script reaches them ([Note: refused DeepSpeed features]). The
table of DeepSpeed's API and tiered's is docs/deepspeed.md.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from tiered.deepspeed import accelerator, comm, moe, ops, runtime, utils, zero
from tiered.deepspeed.client import InitializeResult, initialize_with_client
from tiered.deepspeed.comm import init_distributed
from tiered.deepspeed.engine_compat import as_deepspeed_engine
from tiered.deepspeed.import_alias import install as _install_alias
from tiered.deepspeed.runtime.activation_checkpointing import checkpointing
from tiered.deepspeed.runtime.compiler import is_compile_supported
from tiered.deepspeed.runtime.engine import DeepSpeedEngine
from tiered.deepspeed.unsupported import FEATURES, refuse, refusing_class
from tiered.deepspeed.utils import log_dist, logger
from tiered.engine import Engine
from tiered.errors import ConfigError, DistributedSetupError, UnsupportedConfigError

log = logging.getLogger(__name__)

__version__ = "0.19.8"
"""The DeepSpeed release whose API this module follows (scripts compare it; tiered's own version
is ``tiered.__version__``)."""
__git_hash__ = None
__git_branch__ = None

__all__ = [
    "DeepSpeedEngine",
    "Engine",
    "InferenceEngine",
    "InitializeResult",
    "PipelineEngine",
    "PipelineModule",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "init_distributed",
    "init_inference",
    "initialize",
    "is_compile_supported",
    "log_dist",
    "logger",
    "moe",
    "ops",
    "runtime",
    "tp_model_init",
    "utils",
    "zero",
]

# [Note: refused DeepSpeed features]: the classes scripts reach through this module (isinstance
# works; constructing one raises), and the functions that raise when called.
PipelineModule = refusing_class("PipelineModule", "pipeline", __name__)
PipelineEngine = refusing_class("PipelineEngine", "pipeline", __name__)
InferenceEngine = refusing_class("InferenceEngine", "inference", __name__)
_REFUSED_MODULES = {
    "pipe": "pipeline",
    "inference": "inference",
    "module_inject": "tensor",
    "sequence": "sequence",
}
assert set(_REFUSED_MODULES.values()) <= set(FEATURES)


def init_inference(model: torch.nn.Module | None = None, config: Any = None, **kwargs: Any) -> Any:
    """DeepSpeed-Inference: refused ([Note: refused DeepSpeed features])."""
    refuse("inference", "deepspeed.init_inference(...)")


def tp_model_init(
    model: torch.nn.Module | None = None, tp_size: int = 1, dtype: Any = None, **kwargs: Any
) -> Any:
    """DeepSpeed's tensor-parallel model init: refused ([Note: refused DeepSpeed features])."""
    refuse("tensor", "deepspeed.tp_model_init(...)")


def __getattr__(name: str) -> Any:
    """``deepspeed.pipe`` and the other refused features' modules, reached as attributes."""
    if name in _REFUSED_MODULES:
        refuse(_REFUSED_MODULES[name], f"deepspeed.{name}")
    raise AttributeError(
        f"module {__name__!r} has no attribute {name!r} (docs/deepspeed.md lists what it has)"
    )


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags on `parser`: ``--deepspeed`` (a flag), ``--deepspeed_config``
    (the JSON path initialize reads from ``args``) and their deprecated ``--deepscale`` names."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="Enable DeepSpeed (tiered's engine)"
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file."
    )
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
    dist_backend: str | None = None,
    **hyperparameters: Any,
) -> InitializeResult:
    """DeepSpeed's `deepspeed.initialize`, on tiered's engine: returns ``(engine, optimizer,
    training_dataloader, lr_scheduler)``; `optimizer` is a facade whose param groups carry the lrs
    ([Note: the optimizer facade]), the loader is None without `training_data`, `lr_scheduler`
    the client's, else the config section's, else None. A client `optimizer` (or `lr_scheduler`)
    overrides the config's section, as DeepSpeed documents (logged). Without a process group one
    is started, as DeepSpeed's init_distributed does (`dist_init_required=False`: never).
    `hyperparameters` are tiered.initialize's (lr=, ...)."""
    if model is None:
        raise ConfigError("tiered.deepspeed.initialize: model= is required")
    if mpu is not None:
        raise UnsupportedConfigError("mpu= (model parallelism) is not supported by tiered; pass mpu=None")
    if mesh_param is not None:
        raise UnsupportedConfigError(
            "mesh_param= (sequence/tensor parallel meshes) is not supported by tiered; pass mesh_param=None"
        )
    if config is not None and config_params is not None:
        raise ConfigError("pass config= or config_params= (its old name), not both")
    config = config if config is not None else config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ConfigError("no config: pass config= (a dict or a JSON path), or args with --deepspeed_config")
    if dist_init_required is False:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            raise DistributedSetupError(
                "dist_init_required=False but torch.distributed is not initialised under WORLD_SIZE="
                f"{os.environ['WORLD_SIZE']}: call torch.distributed.init_process_group() first"
            )
    else:
        init_distributed(dist_backend, distributed_port=distributed_port)
    out = initialize_with_client(
        model,
        config,
        model_parameters=model_parameters if model_parameters is not None else _all_trainable(model),
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
        **hyperparameters,
    )
    as_deepspeed_engine(out.engine)
    return out


def _all_trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


_install_alias()  # last: every name above exists when a script's `import deepspeed` reaches it
