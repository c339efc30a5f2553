"""GPUBackend: the compute device's memory as a storage tier (host memory on a CPU-only host)."""

from __future__ import annotations

from typing import Any

import torch

from tiered.device import Device, default_device
from tiered.storage.base import Capabilities, Capacity
from tiered.storage.resident import ResidentMemoryBackend


class GPUBackend(ResidentMemoryBackend):
    """Resident tensors in device memory; memory-like (``allocate`` / ``view``).

    Budget-agnostic on purpose: the tier manager owns the "gpu" budget, and CUDA's caching
    allocator already recycles freed blocks, so no pool sits in between. On a CPU-only host the
    device is the CPU and "device memory" is ordinary host memory (docs/architecture.md, "Without a GPU").

    Args:
        device: "cuda", "cuda:1", "cpu" or None for the process's compute device.
    """

    name = "gpu"
    static_capabilities = None  # depends on the device: see `capabilities`

    def __init__(self, device: str | None = None) -> None:
        if device is None:
            dev = default_device()
        else:
            kind, _, index = str(device).partition(":")
            dev = Device(kind, int(index) if index else 0)
        super().__init__(dev)
        self._device_arg = device

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            persistent=False,
            memory_like=True,
            alignment_bytes=256 if self.device.is_cuda else 64,
            direct_gpu=self.device.is_cuda,
            device=self.device.name,
        )

    def _acquire(self, key: str, nbytes: int) -> torch.Tensor:
        return self.device.alloc(nbytes)

    def _release(self, buf: torch.Tensor) -> None:
        pass  # dropping the reference returns it to the (caching) allocator

    def capacity(self) -> Capacity:
        free, total = self.device.mem_info()
        return Capacity(total_bytes=total, free_bytes=free)

    def spec(self) -> dict[str, Any]:
        return {"type": self.name, "device": self._device_arg} if self._device_arg else {"type": self.name}
