"""Reusable host buffers in size classes, so that a steady state allocates nothing.

[Note: size-class buffer pool]
Page-locked memory is expensive to allocate (cudaHostAlloc takes milliseconds and serialises the
device) and cheap to keep. Buffers are therefore rounded up to a size class and returned to a
per-class free list instead of being freed. Classes are multiples of a quarter of the previous
power of two (4 KiB minimum), so a buffer wastes at most 25% of its size, while a training step that
moves the same partitions every step reuses the same buffers: `stats().fresh_allocations` stops
growing after the first step.

With ``max_bytes`` the pool is a hard budget: bytes in use plus bytes cached never exceed it;
cached buffers are dropped first, and a request that cannot fit even then is a CapacityError.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiered.errors import CapacityError
from tiered.units import format_bytes

MIN_CLASS_BYTES = 4096


def size_class(nbytes: int) -> int:
    """The buffer size `nbytes` is rounded up to. See [Note: size-class buffer pool]."""
    if nbytes <= MIN_CLASS_BYTES:
        return MIN_CLASS_BYTES
    power = 1 << ((nbytes - 1).bit_length() - 1)  # largest power of two below nbytes
    step = max(power // 4, MIN_CLASS_BYTES)
    return (nbytes + step - 1) // step * step


@dataclass(frozen=True)
class PoolStats:
    in_use_bytes: int
    cached_bytes: int
    peak_bytes: int
    fresh_allocations: int
    reuses: int


class BufferPool:
    """Flat uint8 buffers from `alloc(nbytes)`, recycled by size class. Thread-safe."""

    def __init__(
        self, alloc: Callable[[int], torch.Tensor], *, max_bytes: int | None = None, name: str = "pool"
    ):
        self._alloc = alloc
        self.max_bytes = max_bytes
        self.name = name
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._in_use = 0
        self._cached = 0
        self._peak = 0
        self._fresh = 0
        self._reuses = 0

    def acquire(self, nbytes: int, *, what: str = "buffer") -> torch.Tensor:
        """A buffer of ``size_class(nbytes)`` bytes (slice it to `nbytes`); contents undefined."""
        cls = size_class(nbytes)
        with self._lock:
            free = self._free.get(cls)
            if free:
                buf = free.pop()
                self._cached -= cls
                self._reuses += 1
            else:
                if self.max_bytes is not None:
                    if self._in_use + cls > self.max_bytes:
                        raise CapacityError(
                            f"{self.name}: {what} needs {format_bytes(nbytes, binary=True)} "
                            f"({format_bytes(cls, binary=True)} with rounding) but "
                            f"{format_bytes(self._in_use, binary=True)} of max_bytes="
                            f"{format_bytes(self.max_bytes, binary=True)} are in use; free (delete) "
                            "other keys or raise max_bytes"
                        )
                    self._trim_locked(self.max_bytes - self._in_use - cls)
                buf = None
            self._in_use += cls
            self._peak = max(self._peak, self._in_use + self._cached)
        if buf is None:
            try:
                buf = self._alloc(cls)
            except BaseException:
                with self._lock:
                    self._in_use -= cls
                raise
            with self._lock:
                self._fresh += 1
        return buf

    def release(self, buf: torch.Tensor) -> None:
        cls = buf.numel()
        with self._lock:
            self._in_use -= cls
            self._free.setdefault(cls, []).append(buf)
            self._cached += cls

    def _trim_locked(self, allowed_cached: int) -> None:
        """Drop cached buffers (largest first) until at most `allowed_cached` bytes stay cached."""
        for cls in sorted(self._free, reverse=True):
            free = self._free[cls]
            while free and self._cached > allowed_cached:
                free.pop()
                self._cached -= cls

    def clear(self) -> None:
        """Drop every cached buffer (buffers in use are unaffected)."""
        with self._lock:
            self._free.clear()
            self._cached = 0

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(self._in_use, self._cached, self._peak, self._fresh, self._reuses)
