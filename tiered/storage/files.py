"""Helpers for file-backed backends: directory checks, temp names, atomic replace.

[Note: atomic file writes]
A key's bytes go to a temp file in the same directory (same filesystem, so the rename is atomic),
are fsync'ed, and the temp file is then ``os.replace``d over the key's file. A reader therefore sees
either the old complete file or the new complete file, never a mix. A failed or cancelled write
closes and unlinks its temp file and leaves the old file untouched. Temp names contain ``~``, a
character `check_key` never allows, so no key can collide with a temp file, and stale temp files of
a crashed process are recognisable (`is_temp_name`).

[Note: opening files found in a shared folder]
A backend's folder (an ``nvme_path`` on a scratch disk) may be writable by others, who can put
anything under a key's name: a FIFO, whose plain open blocks until a writer comes (every run on
that path then hangs in its first read), a device, or a symlink to a file of this user elsewhere
(a write through it would overwrite that file). So a backend opens a key's file with
`open_own_file`: ``O_NOFOLLOW`` (a symlink is refused, not followed), ``O_NONBLOCK`` (a FIFO or
device opens at once instead of blocking; cleared again once the file is known to be regular),
``O_CLOEXEC``, then ``fstat``: anything but a regular file of this user is refused with a
StorageIOError naming the path and what to do. Nothing found in such a folder is opened otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import uuid
from pathlib import Path

from tiered.config.user_files import kind_of as kind_of  # the words for a file's kind, one copy
from tiered.errors import StorageIOError

TEMP_MARK = "~tmp-"


def temp_path(directory: Path, key: str) -> Path:
    """A fresh temp file name for `key` inside `directory`."""
    return directory / f"{key}{TEMP_MARK}{uuid.uuid4().hex[:12]}"


def is_temp_name(name: str) -> bool:
    return TEMP_MARK in name


def open_own_file(path: str | os.PathLike[str], flags: int, *, backend: str, mode: int = 0o600) -> int:
    """An fd of `path`, which must be a regular file owned by this user; anything else is refused
    without blocking ([Note: opening files found in a shared folder]). FileNotFoundError passes
    through, for the caller's own "no such key"."""
    name = os.fspath(path)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _foreign(name, backend, "a symlink", exc.errno) from exc
        if exc.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise _foreign(name, backend, "a FIFO", exc.errno) from exc
        if exc.errno != errno.ENOENT:  # e.g. O_DIRECT on a FIFO is EINVAL: say what is there
            try:
                found = os.lstat(name).st_mode
            except OSError:
                found = stat.S_IFREG
            if not stat.S_ISREG(found):
                raise _foreign(name, backend, kind_of(found), exc.errno) from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _foreign(name, backend, kind_of(st.st_mode), errno.EINVAL)
        if st.st_uid != os.geteuid():
            err = StorageIOError(
                f"{backend} backend: {name!r} is owned by uid {st.st_uid}, not by this user (uid "
                f"{os.geteuid()}): tiered did not write it and will not use it; remove it, or give the "
                "backend a folder only you can write to"
            )
            err.errno = errno.EPERM
            raise err
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _foreign(name: str, backend: str, kind: str, code: int | None) -> StorageIOError:
    err = StorageIOError(
        f"{backend} backend: {name!r} is {kind}, not a regular file: tiered did not put it there and "
        "will not open it (someone else can write into this folder); remove it, or give the backend "
        "a folder only you can write to"
    )
    err.errno = code
    return err


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
