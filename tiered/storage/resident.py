"""Shared core of memory-like backends (GPU memory, pinned host memory): resident tensors by key.

[Note: atomic writes to memory]
A memory backend keeps one resident buffer per key. A write must never leave a half-copied buffer
visible, yet large copies must not block the event loop. So: a small write (up to
`inline_copy_bytes`) whose key already has a big enough buffer copies in place on the loop — there
is no await between start and end, so nothing can observe or cancel it halfway. A larger write
copies into a fresh buffer (from the pool: no allocation in a steady state) off the loop (through
the backend's `IOBridge` on the host, the side stream on CUDA) and swaps it in only when the copy is complete; a
cancelled or failed write waits for its copy to stop touching the new buffer, returns it to the pool
and leaves the old copy in place. The price is one extra buffer per large write in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiered.device import Device
from tiered.errors import StorageIOError, StorageKeyError
from tiered.storage.base import StorageBackend, check_key, check_out_size, tensor_bytes
from tiered.storage.bridge import CapacityLimiter


@dataclass
class _Resident:
    buf: torch.Tensor  # flat uint8, possibly larger than nbytes (size class)
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def tensor(self) -> torch.Tensor:
        flat = self.buf[: self.nbytes]
        return (flat.view(self.dtype) if self.nbytes else flat.new_empty(0, dtype=self.dtype)).view(
            self.shape
        )


class ResidentMemoryBackend(StorageBackend):
    """Base of memory-like backends; subclasses provide `_acquire` / `_release` and capabilities."""

    inline_copy_bytes: int = 4 << 20
    io_concurrency = 2  # large host copies in flight at once (memory bandwidth, not threads, bounds them)

    def __init__(self, device: Device) -> None:
        self.device = device
        self._entries: dict[str, _Resident] = {}
        self._closed = False
        self._limiter = CapacityLimiter(self.io_concurrency, name=f"{self.name} backend copies")

    # ---- hooks -------------------------------------------------------------------------------
    def _acquire(self, key: str, nbytes: int) -> torch.Tensor:
        raise NotImplementedError

    def _release(self, buf: torch.Tensor) -> None:
        raise NotImplementedError

    # ---- helpers -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StorageIOError(f"backend {self.name!r} is closed; open a new one with tiered.open_backend")

    def _get(self, key: str) -> _Resident:
        check_key(key)
        entry = self._entries.get(key)
        if entry is None:
            raise StorageKeyError(
                f"key {key!r} not found in backend {self.name!r} ({self.device.name} memory)"
            )
        return entry

    async def _copy(self, dst: torch.Tensor, src: torch.Tensor, *, what: str) -> None:
        """dst.copy_(src) without blocking the loop; on cancel, returns only once dst is untouched."""
        if dst.device.type == "cuda" or src.device.type == "cuda":
            event = self.device.copy_async(dst, src)
            try:
                await self.device.wait(event, what=what)
            except BaseException:
                event.synchronize()  # the side stream may still be writing dst
                raise
            return
        if dst.numel() <= self.inline_copy_bytes:
            dst.copy_(src)
            return
        # a cancelled copy returns only once dst is quiet (a running memcpy: milliseconds)
        await self.bridge.run(dst.copy_, src, limiter=self._limiter)

    # ---- contract ----------------------------------------------------------------------------
    async def write(self, key: str, tensor: torch.Tensor) -> None:
        self._check_open()
        check_key(key)
        src = tensor_bytes(tensor, what=f"write of key {key!r}")
        n = src.numel()
        old = self._entries.get(key)
        meta = (tensor.dtype, tuple(tensor.shape))
        if old is not None and old.tensor().data_ptr() == tensor.data_ptr() and old.nbytes == n and n:
            old.dtype, old.shape = meta  # writing the resident tensor back to itself
            return
        if (
            old is not None
            and n <= self.inline_copy_bytes
            and old.buf.numel() >= n
            and src.device == old.buf.device
            and src.device.type == "cpu"
        ):
            old.buf[:n].copy_(src)  # no await: atomic, see [Note: atomic writes to memory]
            old.nbytes, (old.dtype, old.shape) = n, meta
            return
        buf = self._acquire(key, n)
        try:
            await self._copy(buf[:n], src, what=f"write of key {key!r}")
        except BaseException:
            self._release(buf)
            raise
        # Re-read: another write or a delete of this key may have completed during the await.
        old = self._entries.get(key)
        self._entries[key] = _Resident(buf, n, *meta)
        if old is not None:
            self._release(old.buf)

    async def read(self, key: str, out: torch.Tensor) -> None:
        self._check_open()
        entry = self._get(key)
        dst = tensor_bytes(out, what=f"read of key {key!r}")
        check_out_size(key, entry.nbytes, dst.numel(), where=f"{self.name} backend")
        if entry.nbytes:
            await self._copy(dst, entry.buf[: entry.nbytes], what=f"read of key {key!r}")

    async def delete(self, key: str) -> None:
        self._check_open()
        entry = self._get(key)
        del self._entries[key]
        self._release(entry.buf)

    async def exists(self, key: str) -> bool:
        self._check_open()
        return check_key(key) in self._entries

    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self._check_open()
        check_key(key)
        if numel < 0:
            raise ValueError(f"allocate({key!r}): numel must be >= 0, got {numel}")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        n = numel * itemsize
        buf = self._acquire(key, n)
        old = self._entries.get(key)
        entry = _Resident(buf, n, dtype, (numel,))
        self._entries[key] = entry
        if old is not None:
            self._release(old.buf)
        return entry.tensor()

    def view(self, key: str) -> torch.Tensor:
        self._check_open()
        return self._get(key).tensor()

    def resident_bytes(self) -> int:
        """Payload bytes held (without size-class rounding)."""
        return sum(e.nbytes for e in self._entries.values())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for entry in self._entries.values():
            self._release(entry.buf)
        self._entries.clear()
