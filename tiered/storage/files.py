"""Helpers for file-backed backends: directory checks, temp names, atomic replace.

[Note: atomic file writes]
A key's bytes go to a temp file in the same directory (same filesystem, so the rename is atomic),
are fsync'ed, and the temp file is then ``os.replace``d over the key's file. A reader therefore sees
either the old complete file or the new complete file, never a mix. A failed or cancelled write
closes and unlinks its temp file and leaves the old file untouched. Temp names contain ``~``, a
character `check_key` never allows, so no key can collide with a temp file, and stale temp files of
a crashed process are recognisable (`is_temp_name`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from pathlib import Path

from tiered.errors import StorageIOError

TEMP_MARK = "~tmp-"


def temp_path(directory: Path, key: str) -> Path:
    """A fresh temp file name for `key` inside `directory`."""
    return directory / f"{key}{TEMP_MARK}{uuid.uuid4().hex[:12]}"


def is_temp_name(name: str) -> bool:
    return TEMP_MARK in name


def remove_quietly(path: Path | str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def fsync_directory(directory: Path) -> None:
    """Make a completed rename durable (best effort: some filesystems refuse a directory fsync)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def adopt_into(source: str | os.PathLike[str], final: Path, *, durable: bool, backend: str, key: str) -> int:
    """`StorageBackend.adopt_file` for a backend keeping `key` as the plain file `final`: the
    complete file `source` (same directory) renamed over it, fsynced first and the rename made
    durable when `durable` ([Note: atomic file writes]); the new object's size. On failure the
    old file is untouched. Blocking: run it on the bridge."""
    src = Path(source)
    if src.parent.resolve() != final.parent.resolve():
        raise StorageIOError(
            f"{backend} backend: adopt_file of key {key!r}: {str(src)!r} is not in the key's directory "
            f"{str(final.parent)!r} (a rename across directories may not be atomic)"
        )
    try:
        nbytes = os.stat(src).st_size
        if durable:
            fd = os.open(src, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(src, final)
        if durable:
            fsync_directory(final.parent)
    except OSError as exc:
        raise StorageIOError(
            f"{backend} backend: adopt_file of key {key!r} from {str(src)!r} failed: {exc.strerror or exc}; "
            "the previous object is intact"
        ) from exc
    return nbytes


def check_directory(path: str | os.PathLike[str], *, backend: str, create: bool = False) -> Path:
    """Resolve `path` to an existing, writable directory or raise StorageIOError naming it."""
    directory = Path(path).expanduser()
    if create:
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # owner only, like the files
        except OSError as exc:
            raise StorageIOError(
                f"{backend} backend: cannot create directory {str(directory)!r}: {exc.strerror or exc}; "
                "pick a path on a writable filesystem"
            ) from exc
    if not directory.exists():
        raise StorageIOError(
            f"{backend} backend: directory {str(directory)!r} does not exist; create it first "
            "(or pass create=True)"
        )
    if not directory.is_dir():
        raise StorageIOError(
            f"{backend} backend: {str(directory)!r} is not a directory; pass a directory path"
        )
    return directory.resolve()


def unwritable_error(directory: Path, backend: str, exc: OSError) -> StorageIOError:
    """The error for a directory that refused a write, with the cure that fits the cause."""
    if exc.errno == errno.EROFS:
        hint = "it is on a read-only filesystem: remount it read-write or pick a path on a writable disk"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        hint = "fix its permissions or pick another path"
    else:
        hint = "pick another path"
    err = StorageIOError(
        f"{backend} backend: directory {str(directory)!r} is not writable ({exc.strerror or exc}); {hint}"
    )
    err.errno = exc.errno
    return err


def probe_writable(directory: Path, *, backend: str) -> None:
    """Create and remove a temp file in `directory`; StorageIOError naming it if that fails."""
    probe = temp_path(directory, "tiered-probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        raise unwritable_error(directory, backend, exc) from exc
    os.close(fd)
    remove_quietly(probe)
