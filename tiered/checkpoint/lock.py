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

[Note: one run per folder]
Two ``tiered finetune`` runs given the same ``--out`` would each pass the check that the folder
holds no other run's checkpoints (neither has saved yet), then save steps into one
``checkpoints/`` and export over each other's ``final/``: the save lock serialises their saves
but cannot tell them apart. So a run (rank 0) holds ``flock(LOCK_EX)`` on ``<out>/.run.lock`` from
before it looks at the folder until it has exported and reported, by the same mechanism as the
save lock (kernel-dropped when its process dies, the holder's pid and host in the file, the file
kept), but without waiting: a second run is refused at once with RunLockError naming the holder,
since waiting would start a second training of the same model the moment the first ends.
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
from tiered.errors import CheckpointLockError, RunLockError

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
RUN_LOCK_FILE = ".run.lock"
LOCK_TIMEOUT_S = 600.0
"""How long a save waits for another saver of the same folder (a large save takes minutes)."""
_POLL_S = 0.05
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class _LockFile:
    """A lock file held with flock while this object holds its fd; `_wait` takes the lock."""

    def __init__(self, path: str) -> None:
        self.path = path
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
            write_holder(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _wait(self, fd: int) -> None:
        raise NotImplementedError

    def release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)  # drops the flock

    def __enter__(self) -> _LockFile:
        self.acquire()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class SaveLock(_LockFile):
    """``with SaveLock(save_dir):`` - see [Note: checkpoint save lock]."""

    def __init__(self, save_dir: str, timeout_s: float | None = None) -> None:
        super().__init__(os.path.join(save_dir, LOCK_FILE))
        self.timeout_s = LOCK_TIMEOUT_S if timeout_s is None else float(timeout_s)

    def _wait(self, fd: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        waited = False
        while not try_flock(fd, self.path, "saving without the save lock; make sure no other process saves"):
            if not waited:
                log.warning(
                    "%s is held by %s: waiting up to %g s for that save",
                    self.path,
                    holder(fd),
                    self.timeout_s,
                )
                waited = True
            if time.monotonic() >= deadline:
                raise CheckpointLockError(
                    f"checkpoint folder {os.path.dirname(self.path)} is being saved into by another process "
                    f"({holder(fd)}, holding {self.path}) for more than {self.timeout_s:g} s: wait for it, stop "
                    "it, or save into another folder"
                )
            time.sleep(_POLL_S)


class RunLock(_LockFile):
    """``with RunLock(out_dir):`` - see [Note: one run per folder]. `flag` names the folder's
    option in the refusal."""

    def __init__(self, folder: str, flag: str = "--out") -> None:
        super().__init__(os.path.join(folder, RUN_LOCK_FILE))
        self.folder = folder
        self.flag = flag

    def _wait(self, fd: int) -> None:
        if not try_flock(fd, self.path, "running without the run lock; make sure no other run uses"):
            raise RunLockError(
                f"{self.flag} {self.folder} is in use by another run ({holder(fd)}, holding {self.path}): "
                f"wait for it to end or stop it, or pass another {self.flag}"
            )


def try_flock(fd: int, path: str, unlocked: str) -> bool:
    """Take ``flock(LOCK_EX)`` on `fd` (the file `path`) without blocking: False when another open
    file description holds it. Where the filesystem has no flock, True after a WARNING:
    "`unlocked` into this folder at the same time" (what goes ahead unlocked, and the risk)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in _NO_FLOCK:
            log.warning(
                "cannot lock %s (%s): %s into this folder at the same time", path, e.strerror or e, unlocked
            )
            return True
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
    return False


def write_holder(fd: int) -> None:
    """Record this process as the holder of the lock on `fd`: ``pid <pid> host <host>``."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} host {socket.gethostname()}\n".encode(), 0)


def holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "a process that has not written its pid yet"
