"""A checkpoint directory on disk: staging, atomic publication, the ``latest`` pointer, lookup.

[Note: atomic checkpoint]
A checkpoint ``<save_dir>/<tag>/`` is written into a staging sibling ``<save_dir>/.<tag>.partial``;
every file in it is fsynced, then the directory, then it is renamed to ``<tag>`` and the parent
fsynced; only then is ``latest`` (a text file holding the tag, DeepSpeed's convention) replaced,
itself by writing ``.latest.tmp``, fsyncing and renaming it over ``latest``. A crash at any
point therefore leaves either the old state (a staging directory nobody reads, the old ``latest``)
or the new one; a checkpoint is complete exactly when its ``manifest.json`` exists, and the
manifest is the last file written. Saving a tag that already exists swaps the new directory in
with renameat2(RENAME_EXCHANGE) where the kernel has it (one atomic step), else by moving the old
one aside first (a crash between those two renames leaves it as ``.<tag>.old``: rename it back
by hand). Names starting with "." are never checkpoints.

[Note: private checkpoints]
A checkpoint holds the whole training state (weights, optimizer moments, data position), as the
swap files do, so it gets their permissions: the staging directory is made 0700 (nothing in it
is reachable by another user while it is written, whatever the umask and whoever writes into it),
every file in it is set to 0600 before it is published, ``latest`` is written 0600, and a
``save_dir`` this creates is 0700. A ``save_dir`` the user made keeps its mode. The Hugging Face
export (`tiered.checkpoint.export`) is the run's deliverable and is written with the process's
ordinary permissions (umask).
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import shutil
from typing import Any

from tiered.errors import CheckpointCorruptError, CheckpointNotFoundError, CheckpointSpaceError
from tiered.units import format_bytes

log = logging.getLogger(__name__)

LATEST = "latest"
MANIFEST = "manifest.json"
FORMAT = "tiered-checkpoint"
FORMAT_VERSION = 1
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
_SPACE_MARGIN_BYTES = 16 << 20  # directory entries, the manifest, filesystem rounding


def staging_path(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}.partial")


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag.startswith(".") or "/" in tag or tag in (LATEST, "..") or os.sep in tag:
        raise ValueError(
            f"checkpoint tag {tag!r}: a tag is one directory name, not starting with '.', "
            f"not {LATEST!r} (e.g. 'global_step100')"
        )
    return tag


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: str, obj: Any, mode: int = 0o600) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())


def check_free_space(save_dir: str, need_bytes: int) -> None:
    """Raise CheckpointSpaceError, before anything is written, when `save_dir` cannot hold it."""
    free = shutil.disk_usage(save_dir).free
    if free < need_bytes + _SPACE_MARGIN_BYTES:
        raise CheckpointSpaceError(
            errno.ENOSPC,
            f"not enough free space for a checkpoint in {save_dir}: it needs {need_bytes} bytes "
            f"({format_bytes(need_bytes, binary=True)}) plus {format_bytes(_SPACE_MARGIN_BYTES, binary=True)} "
            f"margin, {free} bytes are free; free space, delete old checkpoints or save elsewhere",
        )


def prepare_staging(save_dir: str, tag: str) -> str:
    """An empty staging directory for `tag` (a leftover of a crashed save is removed), owner
    only, as a `save_dir` this creates. See [Note: private checkpoints]."""
    os.makedirs(save_dir, mode=PRIVATE_DIR, exist_ok=True)
    path = staging_path(save_dir, tag)
    if os.path.lexists(path):
        log.info("removing %s, left by an interrupted save", path)
        shutil.rmtree(path)
    os.mkdir(path, PRIVATE_DIR)
    return path


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a)


def publish(save_dir: str, tag: str, staging: str) -> str:
    """fsync `staging`, move it to ``<save_dir>/<tag>``, fsync the parent. See [Note: atomic checkpoint]
    and [Note: private checkpoints]."""
    os.chmod(staging, PRIVATE_DIR)
    for name in os.listdir(staging):
        os.chmod(os.path.join(staging, name), PRIVATE_FILE)  # whoever wrote it, with any umask
        fsync_file(os.path.join(staging, name))
    fsync_dir(staging)
    final = os.path.join(save_dir, tag)
    if os.path.lexists(final):
        if _exchange(staging, final):
            fsync_dir(save_dir)
            shutil.rmtree(staging)  # now holds the old checkpoint
        else:
            old = os.path.join(save_dir, f".{tag}.old")
            if os.path.lexists(old):
                shutil.rmtree(old)
            os.rename(final, old)
            os.rename(staging, final)
            fsync_dir(save_dir)
            shutil.rmtree(old)
    else:
        os.rename(staging, final)
    fsync_dir(save_dir)
    return final


def write_latest(save_dir: str, tag: str) -> None:
    tmp = os.path.join(save_dir, ".latest.tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE), "w", encoding="utf-8") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, LATEST))
    fsync_dir(save_dir)


def read_latest(load_dir: str) -> str | None:
    try:
        with open(os.path.join(load_dir, LATEST), encoding="utf-8") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of checkpoint directory `path`; clear errors for missing or half-written ones."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        parent, tag = os.path.split(os.path.normpath(path))
        if os.path.isdir(staging_path(parent, tag)):
            raise CheckpointCorruptError(
                f"checkpoint {path} was never completed (only its staging directory "
                f"{staging_path(parent, tag)} exists: the save was interrupted); load another tag"
            )
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist")
    if not os.path.isfile(mpath):
        raise CheckpointCorruptError(
            f"checkpoint {path} has no {MANIFEST}: it is half-written or not a tiered checkpoint; load another tag"
        )
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"checkpoint manifest {mpath} cannot be read: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{mpath} is not a tiered checkpoint manifest (no format {FORMAT!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{mpath}: format_version {manifest.get('format_version')!r}; this tiered reads version {FORMAT_VERSION}"
        )
    return manifest


def resolve(load_dir: str, tag: str | None) -> str:
    """The checkpoint directory `tag` names under `load_dir`, or the one ``latest`` names."""
    if not os.path.isdir(load_dir):
        raise CheckpointNotFoundError(f"checkpoint directory {load_dir} does not exist")
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            hint = find_latest_valid(load_dir, verify=False)
            raise CheckpointNotFoundError(
                f"{load_dir} has no '{LATEST}' file; pass tag=..."
                + (
                    f" (the newest complete checkpoint there is {hint!r})"
                    if hint
                    else " (no complete checkpoint there)"
                )
            )
        path = os.path.join(load_dir, tag)
        if not os.path.isfile(os.path.join(path, MANIFEST)):
            hint = find_latest_valid(load_dir, verify=False)
            raise CheckpointNotFoundError(
                f"{os.path.join(load_dir, LATEST)} names tag {tag!r}, but {path} is not a complete checkpoint; "
                + (f"the newest complete one is {hint!r}: pass tag={hint!r}" if hint else "none is complete")
            )
        return path
    return os.path.join(load_dir, check_tag(tag))


def find_latest_valid(save_dir: str, *, verify: bool = True) -> str | None:
    """The tag of the newest complete checkpoint under `save_dir` (most global steps, then newest
    manifest), or None. With `verify`, every file's checksum is checked too (reads them all)."""
    from tiered.checkpoint.stream import verify_file

    best: tuple[int, float, str] | None = None
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return None
    for name in names:
        path = os.path.join(save_dir, name)
        if name.startswith(".") or not os.path.isdir(path):
            continue
        try:
            m = read_manifest(path)
            for fname, rec in m["files"].items():
                fpath = os.path.join(path, fname)
                if verify:
                    verify_file(fpath, rec)
                elif os.path.getsize(fpath) != rec["bytes"]:
                    raise CheckpointCorruptError(fpath)
        except (CheckpointCorruptError, CheckpointNotFoundError, OSError, KeyError, TypeError) as e:
            log.info("skipping %s: %s", path, e)
            continue
        counters = m.get("training") or m.get("counters") or {}  # an engine's, or save_tensors' caller's
        key = (int(counters.get("global_steps", -1)), os.path.getmtime(os.path.join(path, MANIFEST)), name)
        if best is None or key > best:
            best = key
    return None if best is None else best[2]
