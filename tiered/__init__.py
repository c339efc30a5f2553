"""tiered: train models larger than the GPU by moving state across GPU, pinned CPU and NVMe tiers."""

from __future__ import annotations

from tiered.errors import (
    BackendImportError,
    BackendNotFoundError,
    CapacityError,
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSpaceError,
    ConfigError,
    KernelBuildWarning,
    LossScaleError,
    ManagerClosedError,
    PinnedError,
    ShapeMutationError,
    StorageIOError,
    StorageKeyError,
    TieredError,
    TierTimeoutError,
    UnsupportedConfigError,
)
from tiered.storage.registry import open_backend, register_backend

__version__ = "0.1.0"

from tiered.engine import Engine, initialize  # noqa: E402 - after __version__: engine modules may read it

__all__ = [
    "BackendImportError",
    "BackendNotFoundError",
    "CapacityError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSpaceError",
    "ConfigError",
    "Engine",
    "KernelBuildWarning",
    "LossScaleError",
    "ManagerClosedError",
    "PinnedError",
    "ShapeMutationError",
    "StorageIOError",
    "StorageKeyError",
    "TieredError",
    "TierTimeoutError",
    "UnsupportedConfigError",
    "initialize",
    "open_backend",
    "register_backend",
    "__version__",
]
