"""``deepspeed.accelerator.get_accelerator()`` without DeepSpeed: the calls scripts make of it,
answered by torch for the device tiered computes on (CUDA where there is one, else the CPU)."""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["TorchAccelerator", "get_accelerator"]


class TorchAccelerator:
    """DeepSpeed's accelerator interface, the parts training scripts call (CUDA or CPU)."""

    def __init__(self) -> None:
        self._name = "cuda" if torch.cuda.is_available() else "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{device_index}"

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def is_available(self) -> bool:
        return True

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return self._name == "cuda"

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds every CUDA device as well

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def random(self) -> Any:
        return torch.random

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else 0

    def __repr__(self) -> str:
        return f"TorchAccelerator({self._name})"


@functools.cache
def get_accelerator() -> TorchAccelerator:
    """The process's one accelerator object, as DeepSpeed's ``get_accelerator()``."""
    return TorchAccelerator()
