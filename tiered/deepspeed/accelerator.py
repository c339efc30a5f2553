"""``deepspeed.accelerator.get_accelerator()`` without DeepSpeed: the calls scripts make of it,
answered by torch for the device tiered computes on (CUDA where there is one, else the CPU)."""

from __future__ import annotations

import contextlib
import functools
import os
import resource
from typing import Any

import torch

from tiered.errors import UnsupportedConfigError

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

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned()) if self._name == "cuda" else False

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.bfloat16]
        return [*dtypes, torch.float16] if self.is_fp16_supported() else dtypes

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._name == "cuda":
            return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.set_rng_state(new_state, device_index if device_index is not None else "cuda")
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        if self._name == "cuda":
            return torch.cuda.default_generators[device_index]
        return torch.default_generator

    # ---- memory: CUDA's allocator statistics; on the CPU the process's resident memory, as
    # DeepSpeed's CPU accelerator reports it (its allocator is the host's)
    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else _rss_bytes()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else _peak_rss_bytes()

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._name == "cuda" else _rss_bytes()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._name == "cuda" else _peak_rss_bytes()

    def memory_cached(self, device_index: int | None = None) -> int:
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        if self._name == "cuda":
            return dict(torch.cuda.memory_stats(device_index))
        return {"allocated_bytes.all.current": _rss_bytes(), "allocated_bytes.all.peak": _peak_rss_bytes()}

    def total_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return int(torch.cuda.get_device_properties(device_index or 0).total_memory)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return int(torch.cuda.mem_get_info(device_index)[0])
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # ---- streams and events (CUDA's; on the CPU the work is synchronous and these are no-ops)
    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._name == "cuda" else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._name == "cuda" else None

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self._name == "cuda" else contextlib.nullcontext()

    @property
    def Stream(self) -> Any:
        return torch.cuda.Stream if self._name == "cuda" else None

    @property
    def Event(self) -> Any:
        return torch.cuda.Event if self._name == "cuda" else None

    def range_push(self, msg: str) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Any) -> None:
        if self._name == "cuda":
            torch.cuda._lazy_call(callback)
        else:
            callback()

    def is_triton_supported(self) -> bool:
        return False

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._name == "cuda" else []

    def get_compile_backend(self) -> str:
        return "inductor"

    # ---- tensor types, as DeepSpeed's accelerator names them
    @property
    def BFloat16Tensor(self) -> Any:
        return functools.partial(torch.tensor, dtype=torch.bfloat16, device=self._name)

    @property
    def FloatTensor(self) -> Any:
        return functools.partial(torch.tensor, dtype=torch.float32, device=self._name)

    @property
    def HalfTensor(self) -> Any:
        return functools.partial(torch.tensor, dtype=torch.float16, device=self._name)

    @property
    def LongTensor(self) -> Any:
        return functools.partial(torch.tensor, dtype=torch.int64, device=self._name)

    @property
    def IntTensor(self) -> Any:
        return functools.partial(torch.tensor, dtype=torch.int32, device=self._name)

    @property
    def ByteTensor(self) -> Any:
        return functools.partial(torch.tensor, dtype=torch.uint8, device=self._name)

    @property
    def DoubleTensor(self) -> Any:
        return functools.partial(torch.tensor, dtype=torch.float64, device=self._name)

    def create_op_builder(self, class_name: str) -> Any:
        raise UnsupportedConfigError(
            f"get_accelerator().create_op_builder({class_name!r}): tiered builds no DeepSpeed ops; its own "
            "native kernels build once per environment with `tiered build-ext`"
        )

    get_op_builder = create_op_builder

    def __repr__(self) -> str:
        return f"TorchAccelerator({self._name})"


@functools.cache
def get_accelerator() -> TorchAccelerator:
    """The process's one accelerator object, as DeepSpeed's ``get_accelerator()``."""
    return TorchAccelerator()


def _rss_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
