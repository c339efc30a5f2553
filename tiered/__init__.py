"""tiered: train models larger than the GPU by moving state across GPU, pinned CPU and NVMe tiers."""

from __future__ import annotations

from tiered.errors import (
    BackendImportError,
    BackendNotFoundError,
    CapacityError,
    ConfigError,
    StorageIOError,
    StorageKeyError,
    TieredError,
    TierTimeoutError,
    UnsupportedConfigError,
)

__version__ = "0.1.0"

__all__ = [
    "BackendImportError",
    "BackendNotFoundError",
    "CapacityError",
    "ConfigError",
    "StorageIOError",
    "StorageKeyError",
    "TieredError",
    "TierTimeoutError",
    "UnsupportedConfigError",
    "__version__",
]
