"""TensorStoreBackend: any TensorStore kvstore ("file", "memory", "gcs", "s3", ...) as a tier."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorstore as ts
import torch

from tiered.errors import ConfigError, StorageIOError, StorageKeyError
from tiered.storage.base import (
    Capabilities,
    Capacity,
    StorageBackend,
    check_key,
    check_out_size,
    tensor_bytes,
)

_OPEN_TIMEOUT_S = 60.0


class TensorStoreBackend(StorageBackend):
    """Keys are kvstore keys; values are the tensor's raw bytes. Awaits TensorStore futures.

    TensorStore's ``KvStore.write`` accepts only ``bytes``, so a write pays one copy
    (``ndarray.tobytes()``); a read pays one copy from the returned ``bytes`` into the caller's
    tensor. Atomicity per key is the driver's (the "file" driver writes a temp file and renames).
    A cancelled write cannot be recalled from TensorStore: the key then holds either the old
    value or the complete new one, never a mix. TensorStore does its own I/O on its own threads;
    the two host copies run on the backend's `IOBridge` ([Note: one I/O bridge]), off the loop.

    Args:
        kvstore: a kvstore spec dict (``{"driver": "file", "path": "/data/tier/"}``) or URL string.
        persistent: override the capability guess (True unless the driver is "memory").
    """

    name = "tensorstore"
    install_hint = "pip install tensorstore"
    static_capabilities = None  # depends on the driver

    def __init__(self, kvstore: dict[str, Any] | str | None = None, persistent: bool | None = None) -> None:
        self._kvstore_arg: dict[str, Any] | str = {"driver": "memory"} if kvstore is None else kvstore
        try:
            self._kv = ts.KvStore.open(self._kvstore_arg).result(timeout=_OPEN_TIMEOUT_S)
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"tensorstore backend: invalid kvstore spec {self._kvstore_arg!r}: {exc}"
            ) from exc
        driver = (
            self._kvstore_arg.get("driver") if isinstance(self._kvstore_arg, dict) else str(self._kvstore_arg)
        )
        self._persistent = persistent if persistent is not None else not str(driver).startswith("memory")
        self._persistent_arg = persistent

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(persistent=self._persistent, memory_like=False, alignment_bytes=1)

    def _where(self, key: str) -> str:
        return f"kvstore {self._kvstore_arg!r} key {key!r}"

    async def write(self, key: str, tensor: torch.Tensor) -> None:
        check_key(key)
        src = tensor_bytes(tensor, what=f"tensorstore write of key {key!r}").detach()
        if src.device.type != "cpu":
            src = src.cpu()
        # bytes is the only value type KvStore.write accepts: one unavoidable copy.
        value = await self.bridge.run(_to_bytes, src)
        try:
            await self._kv.write(key, value)
        except (ValueError, RuntimeError, OSError) as exc:
            raise StorageIOError(f"tensorstore backend: write to {self._where(key)} failed: {exc}") from exc

    async def read(self, key: str, out: torch.Tensor) -> None:
        check_key(key)
        dst = tensor_bytes(out, what=f"tensorstore read of key {key!r}").detach()
        try:
            result = await self._kv.read(key)
        except (ValueError, RuntimeError, OSError) as exc:
            raise StorageIOError(f"tensorstore backend: read of {self._where(key)} failed: {exc}") from exc
        if result.state == "missing":
            raise StorageKeyError(f"key {key!r} not found in tensorstore backend ({self._kvstore_arg!r})")
        value = result.value
        check_out_size(key, len(value), dst.numel(), where=f"tensorstore {self._kvstore_arg!r}")
        if value:
            host = dst if dst.device.type == "cpu" else torch.empty_like(dst, device="cpu")
            await self.bridge.run(_copy_from_bytes, host, value)
            if host is not dst:
                dst.copy_(host)

    async def delete(self, key: str) -> None:
        if not await self.exists(key):
            raise StorageKeyError(f"key {key!r} not found in tensorstore backend ({self._kvstore_arg!r})")
        try:
            await self._kv.write(key, None)
        except (ValueError, RuntimeError, OSError) as exc:
            raise StorageIOError(f"tensorstore backend: delete of {self._where(key)} failed: {exc}") from exc

    async def exists(self, key: str) -> bool:
        check_key(key)
        result = await self._kv.read(key, byte_range=slice(0, 0))
        return result.state != "missing"

    def capacity(self) -> Capacity:
        return Capacity(total_bytes=None, free_bytes=None)  # a kvstore cannot tell

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.name, "kvstore": self._kvstore_arg}
        if self._persistent_arg is not None:
            out["persistent"] = self._persistent_arg
        return out


def _to_bytes(src: torch.Tensor) -> bytes:
    return np.asarray(src.numpy()).tobytes()


def _copy_from_bytes(host: torch.Tensor, value: bytes) -> None:
    np.copyto(host.numpy(), np.frombuffer(value, dtype=np.uint8))
