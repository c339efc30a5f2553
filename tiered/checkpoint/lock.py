"""The save lock of a checkpoint folder: one saver at a time, a clear error naming the holder.

[Note: checkpoint save lock]
Two processes saving into one folder at once (two runs given the same ``--out``, a user's
script beside a training run) would race on the staging directory, the rename into place and
``latest``: raw FileNotFoundError / ENOTEMPTY, and a ``latest`` naming a checkpoint the other
saver is replacing. So a save (rank 0, which prepares and publishes) holds
``fcntl.flock(LOCK_EX)`` on ``<save_dir>/.lock`` from before its staging directory is made until
``latest`` names the published checkpoint (or the save aborted). flock belongs to the open file
description, so the kernel drops it when its process dies (a kill -9 leaves no stale lock), and a
second saver in the same process conflicts too. The holder writes ``pid <pid> host <host>`` into
the file; a saver that finds it held polls until `timeout_s` (default `LOCK_TIMEOUT_S`) and then
raises CheckpointLockError naming the file and that holder. The lock file stays (removing a file
others may be waiting on lets two of them lock different inodes); its name starts with "." so it
is never taken for a checkpoint. Where the filesystem has no flock the save goes ahead unlocked
with a WARNING. Loads take no lock: what they read is published atomically.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from types import TracebackType

from tiered.checkpoint.paths import open_regular
from tiered.errors import CheckpointLockError

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
LOCK_TIMEOUT_S = 600.0
"""How long a save waits for another saver of the same folder (a large save takes minutes)."""
_POLL_S = 0.05
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class SaveLock:
    """``with SaveLock(save_dir):`` - see [Note: checkpoint save lock]."""

    def __init__(self, save_dir: str, timeout_s: float | None = None) -> None:
        self.path = os.path.join(save_dir, LOCK_FILE)
        self.timeout_s = LOCK_TIMEOUT_S if timeout_s is None else float(timeout_s)
        self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self) -> None:
        if self._fd >= 0:
            return
        fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._wait(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} host {socket.gethostname()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _wait(self, fd: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as e:
                if e.errno in _NO_FLOCK:
                    log.warning(
                        "cannot lock %s (%s): saving without the save lock; make sure no other process "
                        "saves into this folder at the same time",
                        self.path,
                        e.strerror or e,
                    )
                    return
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            if not waited:
                log.warning(
                    "%s is held by %s: waiting up to %g s for that save",
                    self.path,
                    _holder(fd),
                    self.timeout_s,
                )
                waited = True
            if time.monotonic() >= deadline:
                raise CheckpointLockError(
                    f"checkpoint folder {os.path.dirname(self.path)} is being saved into by another process "
                    f"({_holder(fd)}, holding {self.path}) for more than {self.timeout_s:g} s: wait for it, stop "
                    "it, or save into another folder"
                )
            time.sleep(_POLL_S)

    def release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)  # drops the flock

    def __enter__(self) -> SaveLock:
        self.acquire()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "a process that has not written its pid yet"
