"""The aiofiles backend: conformance plus atomic replace under failure and bad directories."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import aiofiles.threadpool.binary
import pytest
import torch
from tiered_aiofiles import AiofilesBackend

from tiered.errors import ConfigError, StorageIOError
from tiered.storage.files import is_temp_name
from tiered.testing import BackendConformance, random_bytes


class TestAiofilesConformance(BackendConformance):
    def make_backend(self, tmp_path):
        return AiofilesBackend(tmp_path)


class TestAiofilesSmallChunksConformance(BackendConformance):
    def make_backend(self, tmp_path):
        return AiofilesBackend(tmp_path, chunk_bytes=100_003, fsync=False)


def test_failed_write_keeps_old_copy_and_no_temp(tmp_path: Path, monkeypatch) -> None:
    async def main() -> None:
        b = AiofilesBackend(tmp_path, chunk_bytes=1 << 20)
        old = random_bytes(3 << 20, seed=1)
        await b.write("k", old)
        real_write = aiofiles.threadpool.binary.AsyncBufferedIOBase.write
        calls = {"n": 0}

        async def failing_write(self, data):
            calls["n"] += 1
            if calls["n"] > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return await real_write(self, data)

        monkeypatch.setattr(aiofiles.threadpool.binary.AsyncBufferedIOBase, "write", failing_write)
        with pytest.raises(StorageIOError, match=r"'k'.*k~tmp-.*No space left"):
            await b.write("k", random_bytes(3 << 20, seed=2))
        monkeypatch.undo()
        assert (tmp_path / "k").read_bytes() == old.numpy().tobytes()
        assert not [p for p in os.listdir(tmp_path) if is_temp_name(p)]

    asyncio.run(main())


def test_file_is_plain_bytes(tmp_path: Path) -> None:
    async def main() -> None:
        b = AiofilesBackend(tmp_path)
        t = torch.arange(33, dtype=torch.int16)
        await b.write("plain", t)
        assert (tmp_path / "plain").read_bytes() == t.numpy().tobytes()

    asyncio.run(main())


def test_bad_directory_and_options(tmp_path: Path) -> None:
    with pytest.raises(StorageIOError, match=f"{tmp_path / 'missing'}.*does not exist"):
        AiofilesBackend(tmp_path / "missing")
    with pytest.raises(ConfigError, match="chunk_bytes"):
        AiofilesBackend(tmp_path, chunk_bytes=0)


def test_unwritable_directory_names_path(tmp_path: Path, monkeypatch) -> None:
    real_open = os.open

    def denied(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)  # root ignores chmod, so simulate EACCES
    with pytest.raises(StorageIOError, match=f"{tmp_path}.*not writable"):
        AiofilesBackend(tmp_path)
