"""tiered: train models larger than the GPU by moving state across GPU, pinned CPU and NVMe tiers."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from tiered.engine import Engine, from_pretrained, initialize
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

try:
    # One source of truth: [project] version in pyproject.toml, read from the installed metadata.
    __version__ = version("tiered")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

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
