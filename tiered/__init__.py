"""tiered: train models larger than the GPU by moving state across GPU, pinned CPU and NVMe tiers."""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any, overload

import torch

from tiered.engine import Engine, from_pretrained
from tiered.engine import initialize as _initialize
from tiered.engine.build import Config
from tiered.errors import (
    AlreadyManagedError,
    BackendExistsError,
    BackendImportError,
    BackendNotFoundError,
    CapacityError,
    CheckpointCorruptError,
    CheckpointLockError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointPathError,
    CheckpointSpaceError,
    CollectiveOrderError,
    ConfigError,
    DistributedSetupError,
    InputDtypeError,
    InputError,
    KernelBuildLockError,
    KernelBuildWarning,
    LossScaleError,
    ManagerClosedError,
    ModelNotInitializedError,
    NonFiniteError,
    ParameterNotGatheredError,
    PinnedError,
    RunLockError,
    ShapeMutationError,
    StorageCorruptError,
    StorageIOError,
    StorageKeyError,
    StoredSizeError,
    TieredError,
    TierTimeoutError,
    UnsupportedConfigError,
    UnsupportedFeatureError,
    UsageError,
    WeightsError,
)
from tiered.storage.registry import open_backend, register_backend

if TYPE_CHECKING:
    from tiered.deepspeed.client import InitializeResult

try:
    # One source of truth: [project] version in pyproject.toml, read from the installed metadata.
    __version__ = version("tiered")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"


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
    """The `Engine` over `model`, partitioned into shard groups over the configured tiers
    (`tiered.engine.initialize`: the config, `process_group`, `weights`, `init_missing` and the
    hyper-parameter keywords are documented there).

    With any of DeepSpeed's keywords (`model_parameters`: parameters or param-group dicts;
    `optimizer`: a client torch Adam/AdamW or DeepSpeed Adam; `lr_scheduler`; `training_data`,
    with `collate_fn`) it returns DeepSpeed's ``(engine, optimizer, dataloader, lr_scheduler)``
    instead, an `InitializeResult` whose engine has DeepSpeed's engine API
    (`tiered.deepspeed.client.initialize_with_client`, [Note: the optimizer facade])."""
    if all(x is None for x in (model_parameters, optimizer, lr_scheduler, training_data)):
        return _initialize(
            model,
            config,
            process_group=process_group,
            weights=weights,
            init_missing=init_missing,
            **hyperparameters,
        )
    from tiered.deepspeed.client import initialize_with_client

    return initialize_with_client(
        model,
        config,
        process_group=process_group,
        model_parameters=model_parameters,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
        weights=weights,
        init_missing=init_missing,
        **hyperparameters,
    )


__all__ = [
    "AlreadyManagedError",
    "BackendImportError",
    "BackendExistsError",
    "BackendNotFoundError",
    "CapacityError",
    "CheckpointCorruptError",
    "CheckpointLockError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointPathError",
    "CheckpointSpaceError",
    "CollectiveOrderError",
    "ConfigError",
    "DistributedSetupError",
    "Engine",
    "KernelBuildLockError",
    "KernelBuildWarning",
    "InputDtypeError",
    "InputError",
    "LossScaleError",
    "ManagerClosedError",
    "ModelNotInitializedError",
    "NonFiniteError",
    "ParameterNotGatheredError",
    "PinnedError",
    "RunLockError",
    "ShapeMutationError",
    "StorageCorruptError",
    "StorageIOError",
    "StorageKeyError",
    "StoredSizeError",
    "TieredError",
    "TierTimeoutError",
    "UnsupportedConfigError",
    "UnsupportedFeatureError",
    "UsageError",
    "WeightsError",
    "from_pretrained",
    "initialize",
    "open_backend",
    "register_backend",
    "__version__",
]
