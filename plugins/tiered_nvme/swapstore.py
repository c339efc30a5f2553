"""`SwapStore`: the nvme backend's swap mode, keyed by an in-memory index.

See [Note: nvme swap index], [Note: nvme slab coalescing] (tiered_nvme.slab) and
[Note: nvme shifted swap files] (tiered_nvme.pieces). Used by `NVMeBackend` when it was opened
with ``swap=True, atomic=False`` (the offload tiers the engine derives). The two own different
things: the backend owns the directory, the files' I/O (pieces, bounce buffers, the limiter on
its bridge), its contract checks, errors and staging of CUDA tensors; this object owns the index
(which key lies in which file or slab slot) and the slab, and reaches the backend only through
the public `SwapFiles` interface below (no import of the backend, no private member).
Everything runs on the loop that calls the backend, except the blocking calls, which go through
the backend's bridge under its limiter.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from tiered.errors import StorageCorruptError, StorageIOError, StorageKeyError
from tiered.storage.base import LocalFile, check_out_size
from tiered.storage.files import adopt_into, open_own_file
from tiered.units import align_up
from tiered_nvme.pieces import ALIGN, TRUNCATED_REMEDY, FileEndedEarly
from tiered_nvme.slab import Coalescer, SlabSlots, Slot, SwapEntry


class SwapFiles(Protocol):
    """What a `SwapStore` needs from its owner's file I/O (`NVMeBackend` provides it)."""

    directory: Path
    direct: bool
    fsync: bool
    chunk_bytes: int
    workers: int

    def key_path(self, key: str) -> Path: ...

    async def run_blocking(self, calls: list[tuple[Any, ...]]) -> list[Any]: ...

    async def run_one(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    async def write_file_in_place(
        self, key: str, final: Path, src: torch.Tensor, shift: int, prior_bytes: int | None, file_bytes: int
    ) -> None: ...

    async def read_file(self, key: str, path: Path, dst: torch.Tensor, shift: int | None) -> None: ...


SLAB_FILE = "~slab"
"""The slab file's name: a '~' is in no key (`check_key`), so no key's file can collide with it."""


class SwapStore:
    """Where a swap backend's keys live: own files (large) or slab slots (small)."""

    def __init__(self, backend: SwapFiles, coalesce_bytes: int) -> None:
        self.backend = backend
        self.coalesce_bytes = coalesce_bytes
        self.entries: dict[str, SwapEntry] = {}
        self.slots = SlabSlots()
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._slab_fd = -1
        self._slab_lock = threading.Lock()
        self._closed = False
        self.coalescer = Coalescer(
            backend.run_one,
            self._slab,
            direct=backend.direct,
            chunk_bytes=backend.chunk_bytes,
            workers=backend.workers,
        )

    @property
    def slab_path(self) -> Path:
        return self.backend.directory / SLAB_FILE

    def _slab(self) -> int:
        """The slab's descriptor, opened on first use (in a bridge thread, never on the loop)."""
        with self._slab_lock:
            if self._closed:
                raise StorageIOError(f"nvme backend at {str(self.backend.directory)!r} is closed")
            if self._slab_fd < 0:
                flags = os.O_RDWR | os.O_CREAT | (getattr(os, "O_DIRECT", 0) if self.backend.direct else 0)
                self._slab_fd = open_own_file(
                    self.slab_path, flags, backend="nvme"
                )  # [Note: opening files found in a shared folder]
            return self._slab_fd

    def hold(self, key: str) -> _KeyHold:
        """One operation per key at a time: a slot or file is never freed under a running read."""
        return _KeyHold(self._locks, key)

    def get(self, key: str) -> SwapEntry:
        entry = self.entries.get(key)
        if entry is None:
            raise StorageKeyError(
                f"key {key!r} not found in nvme backend (swap directory {str(self.backend.directory)!r})"
            )
        return entry

    # ---- operations --------------------------------------------------------------------------
    async def write(self, key: str, src: torch.Tensor) -> None:
        n = src.numel()
        async with self.hold(key):
            old = self.entries.get(key)
            if 0 < n <= self.coalesce_bytes:
                slot = (
                    old.slot
                    if old is not None and old.slot and old.slot.capacity == align_up(n, ALIGN)
                    else None
                )
                fresh = slot is None
                slot = slot or self.slots.take(n)
                try:
                    await self._slab_io(True, key, slot, src)
                except BaseException:
                    if fresh:
                        self.slots.give(slot)
                    raise
                self.entries[key] = SwapEntry(n, slot=slot)
                if old is not None and old.slot is None:
                    await self.backend.run_blocking(
                        [(_unlink_quietly, self.backend.key_path(key))]
                    )  # was a file
                elif old is not None and old.slot is not None and old.slot != slot:
                    self.slots.give(old.slot)
                return
            shift = src.data_ptr() % ALIGN if self.backend.direct and n else 0
            file_bytes = align_up(shift + n, ALIGN) if self.backend.direct else n
            prior = old.file_bytes if old is not None and old.slot is None else None
            if prior is not None and 0 <= prior - file_bytes < max(file_bytes // 4, 1 << 20):
                file_bytes = prior  # keep the blocks: a shrink and a regrow cost an allocation each
            await self.backend.write_file_in_place(
                key, self.backend.key_path(key), src, shift, prior, file_bytes
            )
            self.entries[key] = SwapEntry(n, shift=shift, file_bytes=file_bytes)
            if old is not None and old.slot is not None:
                self.slots.give(old.slot)

    async def read(self, key: str, dst: torch.Tensor) -> None:
        async with self.hold(key):
            entry = self.get(key)
            check_out_size(
                key, entry.nbytes, dst.numel(), where=f"swap directory {str(self.backend.directory)!r}"
            )
            if entry.slot is not None:
                await self._slab_io(False, key, entry.slot, dst)
                return
            await self.backend.read_file(key, self.backend.key_path(key), dst, entry.shift)

    def local_file(self, key: str) -> LocalFile | None:
        """Where `key`'s payload lies: its own file at its shift, or its slab slot."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        if entry.slot is not None:
            return LocalFile(str(self.slab_path), entry.slot.offset, entry.nbytes)
        return LocalFile(str(self.backend.key_path(key)), entry.shift, entry.nbytes)

    async def adopt(self, key: str, path: str) -> None:
        """`StorageBackend.adopt_file`: the file becomes `key`'s own, payload at 0, unpadded (the
        next in-place write pads it again); a slab slot it had is freed."""
        final = self.backend.key_path(key)
        async with self.hold(key):
            old = self.entries.get(key)
            (nbytes,) = await self.backend.run_blocking(
                [(lambda: adopt_into(path, final, durable=self.backend.fsync, backend="nvme", key=key),)]
            )
            self.entries[key] = SwapEntry(nbytes, shift=0, file_bytes=nbytes)
            if old is not None and old.slot is not None:
                self.slots.give(old.slot)

    async def delete(self, key: str) -> None:
        async with self.hold(key):
            entry = self.get(key)
            del self.entries[key]
            if entry.slot is not None:
                self.slots.give(entry.slot)
            else:
                await self.backend.run_blocking([(os.unlink, self.backend.key_path(key))])

    async def _slab_io(self, write: bool, key: str, slot: Slot, buf: torch.Tensor) -> None:
        try:
            await self.coalescer.submit(write, slot, buf)
        except OSError as exc:
            if isinstance(exc, StorageIOError):
                raise
            op = "write" if write else "read"
            short = isinstance(exc, FileEndedEarly)
            raise (StorageCorruptError if short else StorageIOError)(
                f"nvme backend: {op} of key {key!r} in slab {str(self.slab_path)!r} (offset "
                f"{slot.offset}) failed: {exc.strerror or exc}" + (f"; {TRUNCATED_REMEDY}" if short else "")
            ) from exc

    def exists(self, key: str) -> bool:
        return key in self.entries

    def close(self) -> None:
        with self._slab_lock:
            self._closed = True
            if self._slab_fd >= 0:
                os.close(self._slab_fd)
                self._slab_fd = -1


class _KeyHold:
    """``async with``: the key's lock, dropped from the table when its last user leaves (a plain
    class, not a generator context manager: this runs twice per small object)."""

    __slots__ = ("_key", "_lock", "_locks")

    def __init__(self, locks: dict[str, tuple[asyncio.Lock, int]], key: str) -> None:
        self._locks, self._key = locks, key
        lock, users = locks.get(key, (None, 0))
        self._lock = lock or asyncio.Lock()
        locks[key] = (self._lock, users + 1)

    async def __aenter__(self) -> None:
        try:
            await self._lock.acquire()
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()
        self._leave()

    def _leave(self) -> None:
        lock, users = self._locks[self._key]
        if users == 1:
            del self._locks[self._key]
        else:
            self._locks[self._key] = (lock, users - 1)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
