"""A key's file found in a backend's folder is opened only if it is a regular file of this user
([Note: opening files found in a shared folder] in tiered.storage.files): a FIFO, a symlink or
another user's file put there under a key's name is refused with an error naming the path, and
never blocks. For the nvme backend (plain files and the swap slab) and the aiofiles backend."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiered_aiofiles import AiofilesBackend
from tiered_nvme import NVMeBackend

from tiered.errors import StorageIOError
from tiered.storage.base import StorageBackend

BACKENDS: dict[str, Callable[[Path], StorageBackend]] = {
    "nvme": lambda p: NVMeBackend(p, atomic=False, fsync=False),
    "nvme-direct": lambda p: NVMeBackend(p, fsync=False),
    "aiofiles": lambda p: AiofilesBackend(p, fsync=False),
}


def _read_in_thread(b: StorageBackend, key: str) -> BaseException | None:
    """The read's error; fails the test (after unblocking it) if the read blocks."""
    got: list[BaseException | None] = []

    def run() -> None:
        try:
            asyncio.run(b.read(key, torch.empty(16)))
            got.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(15)
    if t.is_alive():  # unblock it, so a regression fails instead of hanging the suite
        try:
            os.close(os.open(b_path(b, key), os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        t.join(15)
        pytest.fail(f"reading key {key!r} blocked on what is in its place")
    return got[0]


def b_path(b: Any, key: str) -> Path:
    return Path(b.directory) / key


def _close(b: StorageBackend) -> None:
    asyncio.run(b.close())


@pytest.mark.parametrize("kind", list(BACKENDS))
def test_a_fifo_under_a_key_name_is_refused_without_blocking(tmp_path: Path, kind: str) -> None:
    b = BACKENDS[kind](tmp_path)
    try:
        os.mkfifo(b_path(b, "k"))
        err = _read_in_thread(b, "k")
        assert isinstance(err, StorageIOError), repr(err)
        assert str(b_path(b, "k")) in str(err) and "a FIFO" in str(err) and "remove it" in str(err), str(err)
    finally:
        _close(b)


@pytest.mark.parametrize("kind", list(BACKENDS))
def test_a_symlink_under_a_key_name_is_not_followed(tmp_path: Path, kind: str) -> None:
    secret = tmp_path / "elsewhere"
    secret.write_bytes(b"\0" * 64)  # a file of this user a write through the link would clobber
    (tmp_path / "store").mkdir()
    b = BACKENDS[kind](tmp_path / "store")
    try:
        b_path(b, "k").symlink_to(secret)
        err = _read_in_thread(b, "k")
        assert isinstance(err, StorageIOError) and "symlink" in str(err), repr(err)
        assert str(b_path(b, "k")) in str(err)
    finally:
        _close(b)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
@pytest.mark.parametrize("kind", list(BACKENDS))
def test_another_users_file_under_a_key_name_is_refused(tmp_path: Path, kind: str) -> None:
    b = BACKENDS[kind](tmp_path)
    try:
        asyncio.run(b.write("k", torch.ones(16)))
        os.chown(b_path(b, "k"), 54321, 54321)
        err = _read_in_thread(b, "k")
        assert isinstance(err, StorageIOError) and "uid 54321" in str(err), repr(err)
    finally:
        _close(b)
