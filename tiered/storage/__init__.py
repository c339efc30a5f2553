"""Storage layer: the backend contract, the registry of backends, shared helpers."""

from __future__ import annotations

from tiered.storage.base import (
    Capabilities,
    Capacity,
    LocalFile,
    StorageBackend,
    check_key,
    check_out_size,
    tensor_bytes,
)
from tiered.storage.bridge import CapacityLimiter, IOBridge, default_bridge
from tiered.storage.registry import (
    ENTRY_POINT_GROUP,
    BackendInfo,
    get_backend_class,
    known_backends,
    open_backend,
    register_backend,
    unregister_backend,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendInfo",
    "Capabilities",
    "Capacity",
    "CapacityLimiter",
    "IOBridge",
    "LocalFile",
    "StorageBackend",
    "check_key",
    "check_out_size",
    "default_bridge",
    "get_backend_class",
    "known_backends",
    "open_backend",
    "register_backend",
    "tensor_bytes",
    "unregister_backend",
]
