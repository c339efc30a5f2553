"""AiofilesBackend: buffered async files via aiofiles — the simple baseline the nvme backend beats."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os
import torch

from tiered.errors import ConfigError, StorageIOError, StorageKeyError
from tiered.storage.base import (
    Capabilities,
    Capacity,
    LocalFile,
    StorageBackend,
    check_key,
    check_out_size,
    tensor_bytes,
)
from tiered.storage.files import (
    adopt_into,
    check_directory,
    fsync_directory,
    open_own_file,
    probe_writable,
    remove_quietly,
    temp_path,
)


class AiofilesBackend(StorageBackend):
    """One plain file per key under `path`, read and written through aiofiles' thread offload.

    Same atomic-replace semantics as the nvme backend ([Note: atomic file writes]); I/O goes
    through the page cache in `chunk_bytes` pieces awaited one after another (what a user writing
    "async file I/O" by hand would do). aiofiles runs each call on the executor of the backend's
    `IOBridge` ([Note: one I/O bridge]), and so do the fsyncs and the ``fstat``. CPU tensors only are read with no extra copy
    (``readinto``); CUDA tensors pass through a host copy.

    Args:
        path: existing writable directory (or ``create=True``).
        chunk_bytes: bytes per awaited read/write call.
        fsync: fsync each file (and the directory) before the rename makes it visible.
    """

    name = "aiofiles"
    install_hint = "pip install aiofiles"
    static_capabilities = Capabilities(persistent=True, memory_like=False, alignment_bytes=1)

    def __init__(
        self,
        path: str | os.PathLike[str],
        chunk_bytes: int = 8 << 20,
        fsync: bool = True,
        create: bool = False,
    ) -> None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ConfigError(
                f"aiofiles backend: chunk_bytes must be a positive integer, got {chunk_bytes!r}"
            )
        self._path_arg = os.fspath(path)
        self.directory: Path = check_directory(path, backend="aiofiles", create=create)
        probe_writable(self.directory, backend="aiofiles")
        self.chunk_bytes = chunk_bytes
        self.fsync = bool(fsync)

    def _file(self, key: str) -> Path:
        return self.directory / check_key(key)

    def local_file(self, key: str) -> LocalFile | None:
        path = self._file(key)  # one plain file per key, exactly its bytes
        try:
            return LocalFile(str(path), 0, path.stat().st_size)
        except FileNotFoundError:
            return None

    async def adopt_file(self, key: str, path: str) -> None:
        await self.bridge.run(
            lambda: adopt_into(path, self._file(key), durable=self.fsync, backend="aiofiles", key=key)
        )

    async def write(self, key: str, tensor: torch.Tensor) -> None:
        final = self._file(key)
        src = tensor_bytes(tensor, what=f"aiofiles write of key {key!r}").detach()
        if src.device.type != "cpu":
            src = src.cpu()
        mv = src.numpy().data
        tmp = temp_path(self.directory, key)
        try:
            async with aiofiles.open(tmp, "wb", executor=self.bridge.executor, opener=_owner_only) as f:
                for off in range(0, len(mv), self.chunk_bytes):
                    await f.write(mv[off : off + self.chunk_bytes])
                await f.flush()
                if self.fsync:
                    await self.bridge.run(os.fsync, f.fileno())
            await aiofiles.os.replace(tmp, final, executor=self.bridge.executor)
        except BaseException as exc:
            remove_quietly(tmp)
            if isinstance(exc, OSError) and not isinstance(exc, StorageIOError):
                raise StorageIOError(
                    f"aiofiles backend: write of key {key!r} to {str(tmp)!r} failed: {exc.strerror or exc}; "
                    "the previous copy, if any, is intact"
                ) from exc
            raise
        if self.fsync:  # make the rename durable
            await self.bridge.run(fsync_directory, self.directory)

    async def read(self, key: str, out: torch.Tensor) -> None:
        path = self._file(key)
        dst = tensor_bytes(out, what=f"aiofiles read of key {key!r}").detach()
        host = dst if dst.device.type == "cpu" else torch.empty_like(dst, device="cpu")
        try:
            async with aiofiles.open(path, "rb", executor=self.bridge.executor, opener=_own_file) as f:
                size = (await self.bridge.run(os.fstat, f.fileno())).st_size
                check_out_size(key, size, host.numel(), where=f"file {str(path)!r}")
                mv = host.numpy().data
                off = 0
                while off < len(mv):
                    got = await f.readinto(mv[off : off + self.chunk_bytes])
                    if not got:
                        raise OSError(f"file ended early at byte {off} of {len(mv)}")
                    off += got
        except FileNotFoundError:
            raise StorageKeyError(
                f"key {key!r} not found in aiofiles backend (no file {str(path)!r})"
            ) from None
        except StorageIOError:
            raise  # a file tiered did not write: the message names it
        except OSError as exc:
            raise StorageIOError(
                f"aiofiles backend: read of key {key!r} from {str(path)!r} failed: {exc.strerror or exc}"
            ) from exc
        if host is not dst:
            dst.copy_(host)

    async def delete(self, key: str) -> None:
        path = self._file(key)
        try:
            await aiofiles.os.remove(path, executor=self.bridge.executor)
        except FileNotFoundError:
            raise StorageKeyError(
                f"key {key!r} not found in aiofiles backend (no file {str(path)!r})"
            ) from None

    async def exists(self, key: str) -> bool:
        path = self._file(key)
        with contextlib.suppress(FileNotFoundError):
            return (await aiofiles.os.stat(path, executor=self.bridge.executor)) is not None
        return False

    def capacity(self) -> Capacity:
        st = os.statvfs(self.directory)
        return Capacity(total_bytes=st.f_blocks * st.f_frsize, free_bytes=st.f_bavail * st.f_frsize)

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.name, "path": self._path_arg}
        if self.chunk_bytes != 8 << 20:
            out["chunk_bytes"] = self.chunk_bytes
        if not self.fsync:
            out["fsync"] = False
        return out


def _owner_only(path: str, flags: int) -> int:
    """Files only their owner can read: they hold optimizer state and weights."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _own_file(path: str, flags: int) -> int:
    """A key's file as found in the folder, which others may write into: [Note: opening files
    found in a shared folder]."""
    return open_own_file(path, flags, backend="aiofiles")
