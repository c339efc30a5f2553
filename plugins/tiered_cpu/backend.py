"""PinnedCPUBackend: page-locked host memory from a size-class pool (no allocation in steady state)."""

from __future__ import annotations

from typing import Any

import torch

from tiered.device import Device, default_device
from tiered.storage.base import Capabilities, Capacity
from tiered.storage.pool import BufferPool, PoolStats
from tiered.storage.resident import ResidentMemoryBackend
from tiered.units import parse_bytes


class PinnedCPUBackend(ResidentMemoryBackend):
    """Resident host tensors, page-locked when CUDA is present and page-aligned always.

    Buffers come from a `tiered.storage.pool.BufferPool` (see [Note: size-class buffer pool]):
    deleting a key returns its buffer for reuse, so a training loop that moves the same partitions
    every step stops allocating after the first. Page-aligned buffers also let the nvme backend read
    files straight into them with O_DIRECT.

    Args:
        max_bytes: optional hard budget (int or "2GiB"); an allocation that cannot fit raises
            CapacityError naming the key. None: bounded by host memory only.
        pin_memory: page-lock buffers when CUDA is present (DeepSpeed's ``pin_memory``).
    """

    name = "cpu"
    static_capabilities = Capabilities(persistent=False, memory_like=True, alignment_bytes=4096, device="cpu")

    def __init__(self, max_bytes: int | str | None = None, pin_memory: bool = True) -> None:
        super().__init__(Device("cpu"))
        self.max_bytes = None if max_bytes is None else parse_bytes(max_bytes, what="cpu backend max_bytes")
        self.pin_memory = bool(pin_memory)
        # Pinning only means something with CUDA; the compute device decides, not this backend's Device.
        self._host_device = default_device() if pin_memory else self.device
        self.pool = BufferPool(
            lambda n: self._host_device.alloc_host(n, pin=self.pin_memory),
            max_bytes=self.max_bytes,
            name="cpu backend",
        )

    def _acquire(self, key: str, nbytes: int) -> torch.Tensor:
        return self.pool.acquire(nbytes, what=f"key {key!r}")

    def _release(self, buf: torch.Tensor) -> None:
        self.pool.release(buf)

    def capacity(self) -> Capacity:
        free, total = self.device.mem_info()
        if self.max_bytes is None:
            return Capacity(total_bytes=total, free_bytes=free)
        in_use = self.pool.stats().in_use_bytes
        return Capacity(total_bytes=self.max_bytes, free_bytes=max(self.max_bytes - in_use, 0))

    def release_cached(self) -> None:
        self.pool.clear()

    def pool_stats(self) -> PoolStats:
        return self.pool.stats()

    async def close(self) -> None:
        await super().close()
        self.pool.clear()

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.name}
        if self.max_bytes is not None:
            out["max_bytes"] = self.max_bytes
        if not self.pin_memory:
            out["pin_memory"] = False
        return out
