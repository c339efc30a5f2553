"""What a checkpoint folder may hold, checked before anything in it is opened or removed.

[Note: nothing foreign in a checkpoint folder]
A checkpoint folder is shared ground: another user, a careless script or an attacker may have
put anything in it. tiered writes only regular files and real directories there, owned by the
process that saves, and never a symlink. So every path found in it (``latest``, ``<tag>/``, the
files a manifest lists, the ``.lock``, a staging leftover) is looked at with ``lstat`` or opened
with ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` before a byte is read: a symlink is
refused (never followed half-way: followed for a read but refused by ``rmtree``), a FIFO or
device is refused without blocking on its open, and what tiered removes (a staging leftover, a
pruned checkpoint) must be a real directory owned by this user. The folder the caller names
(``save_dir``, ``load_dir``) is followed like any path a user gives.
"""

from __future__ import annotations

import errno
import os
import stat

from tiered.config.user_files import unreadable
from tiered.errors import CheckpointCorruptError, CheckpointPathError
from tiered.storage.files import kind_of


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """An fd of regular file `path`: a symlink, FIFO or device there is refused (never opened
    blocking). See [Note: nothing foreign in a checkpoint folder]."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointCorruptError(
                f"{path} is a symlink: tiered writes none in a checkpoint folder and follows none there; "
                "remove it (or load the folder it points to by its own path)"
            ) from e
        if e.errno == errno.ENXIO:  # a FIFO opened for writing without a reader
            raise CheckpointCorruptError(f"{path} is a FIFO, not a file tiered wrote; remove it") from e
        if e.errno == errno.EACCES:
            raise permission_denied(path) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointCorruptError(
            f"{path} is {kind_of(st.st_mode)}, not a regular file: tiered did not write it; remove it"
        )
    return fd


def permission_denied(path: str) -> CheckpointPathError:
    """The error for `path`, which this user may not read: it names the user and the first
    folder on the way that this user cannot enter, or else the file itself."""
    blocked = path
    parent = os.path.dirname(os.path.abspath(path))
    while parent and parent != os.path.dirname(parent):
        if not os.access(parent, os.X_OK, effective_ids=os.access in os.supports_effective_ids):
            blocked = parent
        parent = os.path.dirname(parent)
    return CheckpointPathError(errno.EACCES, unreadable(blocked, "checkpoint path"), blocked)


def lstat_or_none(path: str) -> os.stat_result | None:
    """``os.lstat(path)``, None when nothing is there; a path this user may not look into is
    CheckpointPathError naming the user (never taken for a missing file)."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except PermissionError:
        raise permission_denied(path) from None


def read_small(path: str, limit_bytes: int) -> bytes:
    """The bytes of regular file `path` (at most `limit_bytes`; more is an error)."""
    fd = open_regular(path)
    try:
        data = os.read(fd, limit_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > limit_bytes:
        raise CheckpointCorruptError(f"{path} is longer than {limit_bytes} bytes: tiered did not write it")
    return data


def real_dir(path: str) -> bool:
    """True if `path` is a directory and no symlink; False if nothing is there; raises
    CheckpointPathError for anything else (a file, a symlink, a FIFO ...)."""
    st = lstat_or_none(path)
    if st is None:
        return False
    if stat.S_ISDIR(st.st_mode):
        return True
    raise CheckpointPathError(
        errno.EEXIST,
        f"{path} is {kind_of(st.st_mode)}, not a checkpoint directory: tiered writes none there and "
        "does not replace what it did not write; remove it or use another tag",
        path,
    )


def owned_dir(path: str) -> bool:
    """True if `path` is a real directory owned by this user (one tiered may remove)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def check_save_dir(save_dir: str) -> None:
    """Raise CheckpointPathError naming `save_dir` when it is not a writable folder (a file, a
    dangling path, no write permission), before anything is written."""
    if os.path.lexists(save_dir) and not os.path.isdir(save_dir):
        raise CheckpointPathError(
            errno.ENOTDIR,
            f"checkpoint folder {save_dir} exists and is not a folder: pass a folder path (save_dir)",
            save_dir,
        )
    try:
        os.makedirs(save_dir, mode=0o700, exist_ok=True)  # [Note: private checkpoints]
    except OSError as e:
        raise CheckpointPathError(
            e.errno or errno.EACCES,
            f"cannot create checkpoint folder {save_dir}: {e.strerror or e}; create it or save elsewhere",
            save_dir,
        ) from e
    if not os.access(save_dir, os.W_OK | os.X_OK):
        raise CheckpointPathError(
            errno.EACCES,
            f"checkpoint folder {save_dir} is not writable by this user: fix its permissions or save elsewhere",
            save_dir,
        )
