"""``deepspeed.checkpointing`` (``deepspeed.runtime.activation_checkpointing.checkpointing``):
activation checkpointing as torch's.

[Note: activation checkpointing as torch's]
DeepSpeed's ``checkpointing.checkpoint(function, *args)`` drops a block's activations in the
forward and recomputes them in the backward, restoring the RNG state so that dropout draws the same
masks: what ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)`` does, which
is what this module calls (``non_reentrant_checkpoint``: ``use_reentrant=False``). tiered's ZeRO-3
hooks gather a block's parameters again for the recomputation, as they do for the forward. Its
extras are Megatron model parallelism's: ``partition_activations`` splits saved activations over
the tensor-parallel ranks (with no ``mpu`` there is nothing to split: accepted, logged), a CUDA
RNG tracker per tensor-parallel rank (refused: no tensor parallelism), and two memory layouts
(``contiguous_checkpointing``, accepted as it changes no value; ``checkpoint_in_cpu``, refused:
the recomputed block's inputs stay where they are).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from tiered.deepspeed.unsupported import refuse
from tiered.errors import UnsupportedConfigError

log = logging.getLogger(__name__)

__all__ = [
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
    "set_num_layers",
]

_configured = False
_num_layers: int | None = None


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Run `function(*args)` without keeping its activations; recompute them in the backward."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """As `checkpoint`, through torch's non-reentrant implementation (keyword arguments, inputs
    that need no gradient)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's settings, from the arguments or the config's ``activation_checkpointing``
    section (arguments win), checked as [Note: activation checkpointing as torch's] says."""
    global _configured, _num_layers
    section: dict[str, Any] = {}
    if deepspeed_config is not None:
        if isinstance(deepspeed_config, dict):
            raw = deepspeed_config
        else:
            from tiered.config.loader import read_config_file

            raw = read_config_file(deepspeed_config)
        section = dict(raw.get("activation_checkpointing") or {})
    given = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    section.update({k: v for k, v in given.items() if v is not None})
    if mpu_ is not None:
        refuse("tensor", "deepspeed.checkpointing.configure(mpu_=...)")
    if section.get("cpu_checkpointing"):
        raise UnsupportedConfigError(
            "activation checkpointing with checkpoint_in_cpu / cpu_checkpointing: tiered does not move "
            "checkpointed activations to the CPU; set it false (the recomputation is unchanged)"
        )
    for key in (
        "partition_activations",
        "contiguous_memory_optimization",
        "synchronize_checkpoint_boundary",
        "profile",
    ):
        if section.get(key):
            log.info(
                "activation checkpointing: %s has no effect here (no model parallelism to partition over, "
                "no separate memory layout or timers); the recomputation is torch's",
                key,
            )
    if section.get("number_checkpoints") is not None:
        _num_layers = int(section["number_checkpoints"])
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here between iterations; torch's checkpoint keeps none."""


def set_num_layers(nlayers: int) -> None:
    global _num_layers
    _num_layers = nlayers


def get_cuda_rng_tracker() -> Any:
    refuse("tensor", "deepspeed.checkpointing.get_cuda_rng_tracker()")


def model_parallel_cuda_manual_seed(seed: int) -> None:
    refuse("tensor", "deepspeed.checkpointing.model_parallel_cuda_manual_seed()")
