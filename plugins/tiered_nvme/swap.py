"""Per-process swap directories: private, locked while open, removed on close, reclaimed after a crash.

[Note: nvme swap directories]
A backend opened with ``swap=True`` (the offload tiers the engine derives from a DeepSpeed
``nvme_path``, tiered.config.tiers [Note: default tiers]) writes not into `path` itself but into a
directory of its own::

    <path>/tiered-swap-<host>-<pid>-<random>/
        lock        fcntl.flock(LOCK_EX)'ed for as long as the backend is open
        <key> ...   one file per key (and the temp files of atomic writes)

made by ``mkdtemp`` (so no two backends, of one process or of two, ever share one) and removed
whole by ``close()``. A process that dies without closing leaves its directory behind, but the
kernel drops its flock. So opening a swap backend on `path` first reclaims each directory that

* carries this host's name (pids and locks mean nothing to another machine sharing the filesystem),
* and whose ``lock`` it can take without blocking (so no one holds it: its owner is dead), or that
  has no ``lock`` yet while no process with its pid runs (the owner died before locking it).

A lock held by anyone keeps the directory: a live process, another backend of this very process
(flock belongs to an open file description, so a second ``open`` conflicts even in-process), a
forked child that inherited the descriptor. The owner locks a fresh ``lock.new`` and only then
renames it to ``lock``, so an existing ``lock`` is never one "about to be locked" by a live owner.
A directory without ``lock`` whose pid was reused by an unrelated process is kept (it is empty: the
owner writes nothing before locking). Where the filesystem refuses flock nothing is reclaimed, as
live and dead cannot be told apart. Files directly under `path`, and directories named otherwise,
are never touched: they may be a persistent tier's data or the user's.

`path` may be shared (a scratch disk every user writes into), so a directory that only looks
like a swap directory is judged without trusting it: it must be a real directory (no symlink)
owned by this user, and its ``lock`` is opened ``O_NOFOLLOW | O_NONBLOCK`` and must be a regular
file of this user. Anything else (a FIFO named ``lock`` that would block the open for ever, a
device, a symlink, another user's directory) is kept, with a WARNING naming it, and never opened
blocking or removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import socket
import stat
import tempfile
from pathlib import Path

from tiered.storage.files import unwritable_error
from tiered.units import format_bytes

log = logging.getLogger(__name__)

SWAP_PREFIX = "tiered-swap-"
LOCK_NAME = "lock"
_PENDING_LOCK = "lock.new"
_RANDOM_PART = r"[a-z0-9_]+"  # what tempfile.mkdtemp appends: never a '-', so names parse uniquely


def host_tag() -> str:
    """This machine's name as it appears in swap directory names."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"


class SwapDirectory:
    """A private, flock'ed directory under `parent`; see [Note: nvme swap directories]."""

    def __init__(self, parent: Path) -> None:
        prefix = f"{SWAP_PREFIX}{host_tag()}-{os.getpid()}-"
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        try:
            self._lock_fd = _create_lock(self.path)
        except BaseException:
            remove_tree(self.path)
            raise

    def remove(self) -> int:
        """Delete the directory with everything in it, then drop the lock; the bytes freed.

        The lock is released last, so no other process reclaims the directory under our feet."""
        if self._lock_fd < 0:
            return 0
        try:
            return remove_tree(self.path)
        finally:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _create_lock(directory: Path) -> int:
    pending = directory / _PENDING_LOCK
    fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:  # e.g. a FUSE filesystem: the directory still works, unprotected
            log.warning(
                "nvme backend: cannot lock %s (%s); if this process crashes, remove that directory "
                "by hand, as no later run can tell that it is stale",
                directory,
                exc.strerror or exc,
            )
        os.write(fd, f"pid {os.getpid()} host {socket.gethostname()}\n".encode())  # for humans
        os.rename(pending, directory / LOCK_NAME)
    except BaseException:
        os.close(fd)
        raise
    return fd


def reclaim_stale(parent: Path) -> list[tuple[Path, int]]:
    """Remove the swap directories of dead processes of this host under `parent`.

    Returns (directory, bytes freed) for each removed; never raises for a directory it cannot
    judge or remove (it logs a warning and keeps it)."""
    pattern = re.compile(re.escape(f"{SWAP_PREFIX}{host_tag()}-") + r"(\d+)-" + _RANDOM_PART)
    try:
        with os.scandir(parent) as it:
            candidates = [
                (Path(e.path), int(m[1]))
                for e in it
                if (m := pattern.fullmatch(e.name)) and e.is_dir(follow_symlinks=False)
            ]
    except OSError:
        return []
    removed = []
    for path, pid in candidates:
        try:
            freed = _remove_if_dead(path, pid)
        except OSError as exc:
            log.warning(
                "nvme backend: could not remove stale swap directory %s: %s", path, exc.strerror or exc
            )
            continue
        if freed is not None:
            removed.append((path, freed))
    return removed


def _remove_if_dead(path: Path, pid: int) -> int | None:
    """Bytes freed if `path` belonged to a dead process and is now gone; None if it was kept."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        log.warning(
            "nvme backend: %s looks like a swap directory but is not a directory of this user: left alone",
            path,
        )
        return None
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None if _pid_alive(pid) else remove_tree(path)  # alive: it may be about to lock
    except OSError:
        return None
    try:
        lst = os.fstat(fd)
        if not stat.S_ISREG(lst.st_mode) or lst.st_uid != os.geteuid():
            log.warning(
                "nvme backend: %s is not a lock file this user wrote (mode %o, owner %d): directory left "
                "alone; remove it by hand",
                path / LOCK_NAME,
                lst.st_mode,
                lst.st_uid,
            )
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held (its owner lives), or no flock here (cannot tell): keep it
            return None
        return remove_tree(path)  # still holding the lock: no second reclaimer races with us
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid mkdtemp's caller could have written: never guess "dead"
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def remove_tree(path: Path) -> int:
    """Delete `path` and everything under it without following links; the bytes of files removed.

    Entries that vanish meanwhile (another reclaimer) are skipped, not errors."""
    freed = 0
    try:
        with os.scandir(path) as it:
            entries = list(it)
    except FileNotFoundError:
        return 0
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            freed += remove_tree(Path(entry.path))
            continue
        with contextlib.suppress(FileNotFoundError):
            size = entry.stat(follow_symlinks=False).st_size
            os.unlink(entry.path)
            freed += size
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)
    return freed


def open_swap_directory(root: Path) -> SwapDirectory:
    """[Note: nvme swap directories]: reclaim dead processes' leftovers, then make our own."""
    _log_reclaimed(root, reclaim_stale(root))
    try:
        return SwapDirectory(root)
    except OSError as exc:
        raise unwritable_error(root, "nvme", exc) from exc


def _log_reclaimed(root: Path, removed: list[tuple[Path, int]]) -> None:
    if not removed:
        return
    freed = sum(n for _, n in removed)
    names = ", ".join(p.name for p, _ in removed[:3]) + (
        f" and {len(removed) - 3} more" if len(removed) > 3 else ""
    )
    log.warning(  # visible by default: disk space came back that a crashed run had held
        "nvme backend: removed %d stale swap director%s of dead processes under %s (%s): %d bytes (%s) freed",
        len(removed),
        "y" if len(removed) == 1 else "ies",
        root,
        names,
        freed,
        format_bytes(freed),
    )
