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
by hand; the next save into the folder does it, see [Note: reclaiming interrupted saves]).
Names starting with "." are never checkpoints. Saves into one folder are serialised by
[Note: checkpoint save lock] (tiered/checkpoint/lock.py), and nothing found in the folder is
opened without [Note: nothing foreign in a checkpoint folder] (tiered/checkpoint/paths.py).

[Note: manifest checksum]
The rank files carry checksums in manifest.json, and the manifest carries its own:
``manifest_xxh3_64``, the xxh3-64 of the canonical JSON (sorted keys, no whitespace) of every
other field. So an edited manifest (a piece's ``start_in_shard`` moved by one, ``exp_avg``
pointed at ``exp_avg_sq``, a changed step counter or RNG state) is refused by name instead of
loading a model that is silently off. Like the file checksums it detects edits and corruption,
not a forger (who can recompute it). Manifests of format version 1 have none, so a version 2
manifest rewritten as version 1 (its checksum dropped) would load whatever the edit says: version
1 is refused unless the user asks for it (``TIERED_ACCEPT_CHECKPOINT_FORMAT=1`` in the
environment), and then loads with a WARNING that its edits cannot be detected. Every name and
count the loaders follow is checked besides ([Note: manifest layout checked on read]).

[Note: reclaiming interrupted saves]
A save killed at any point (kill -9, power loss) leaves at most ``.<tag>.partial`` (a staging
directory), ``.<tag>.old`` (between the two renames of a replace without renameat2) and
``.latest.tmp``. The next save into the folder, holding the save lock (so no save is running),
reclaims them with a WARNING: staging leftovers and ``.latest.tmp`` are removed, an ``.<tag>.old``
is renamed back to ``<tag>`` when ``<tag>`` is gone (it is then the only copy) and removed
otherwise. Only real directories owned by this user are removed; anything else is left and named.

[Note: checkpoint tags]
A tag is one directory name: not empty, not starting with ".", not ``latest``, no "/" or NUL or
other control character, no leading or trailing whitespace (``latest`` stores it as text), and
short enough that ``.<tag>.partial`` fits a file name (255 bytes). ``latest`` is read back under
the same rule, so it can only name a checkpoint inside its own folder (never an absolute path or
``../other/tag``).

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
import re
import shutil
from typing import Any

import xxhash

from tiered.checkpoint.paths import lstat_or_none, owned_dir, permission_denied, read_small, real_dir
from tiered.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointPathError,
    CheckpointSpaceError,
    ConfigError,
)
from tiered.units import format_bytes

log = logging.getLogger(__name__)

LATEST = "latest"
MANIFEST = "manifest.json"
FORMAT = "tiered-checkpoint"
FORMAT_VERSION = 2
MANIFEST_CHECKSUM = "manifest_xxh3_64"
_UNCHECKED_VERSIONS = (1,)  # before [Note: manifest checksum]: read only when asked, with a WARNING
ACCEPT_FORMAT_ENV = "TIERED_ACCEPT_CHECKPOINT_FORMAT"
_NAME_MAX_BYTES = 255
_TAG_MAX_BYTES = _NAME_MAX_BYTES - len("..partial")
_LATEST_MAX_BYTES = 4096
_MANIFEST_MAX_BYTES = 1 << 30
_BAD_TAG_CHARS = re.compile(r"[\x00-\x1f\x7f/]")
_LEFTOVER = re.compile(r"\.(.+)\.(partial|old)")
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
_SPACE_MARGIN_BYTES = 16 << 20  # directory entries, the manifest, filesystem rounding


def staging_path(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}.partial")


def check_tag(tag: str) -> str:
    """`tag` if it is a valid checkpoint tag ([Note: checkpoint tags]), else ValueError naming it."""
    tag = str(tag)
    why = None
    if not tag or tag.startswith(".") or tag == LATEST or os.sep in tag:
        why = f"not empty, not starting with '.', not {LATEST!r}"
    elif _BAD_TAG_CHARS.search(tag):
        why = "no '/', NUL or other control character"
    elif tag != tag.strip():
        why = "no leading or trailing whitespace"
    elif len(os.fsencode(tag)) > _TAG_MAX_BYTES:
        why = f"at most {_TAG_MAX_BYTES} bytes (it is {len(os.fsencode(tag))})"
    if why is not None:
        shown = tag if len(tag) <= 80 else f"{tag[:40]}...{tag[-20:]}"
        raise ValueError(
            f"checkpoint tag {shown!r}: a tag is one directory name ({why}); e.g. 'global_step100'"
        )
    return tag


def manifest_digest(manifest: dict[str, Any]) -> str:
    """xxh3-64 of `manifest` without its own checksum field ([Note: manifest checksum])."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8"))


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
    """An empty staging directory for `tag`, owner only, as a `save_dir` this creates (see
    [Note: private checkpoints]); the caller holds the save lock, so leftovers of interrupted
    saves are reclaimed first ([Note: reclaiming interrupted saves])."""
    os.makedirs(save_dir, mode=PRIVATE_DIR, exist_ok=True)
    reclaim_interrupted(save_dir)
    real_dir(os.path.join(save_dir, tag))  # a symlink or file there: refused before writing
    path = staging_path(save_dir, tag)
    if os.path.lexists(path):  # not ours to remove (reclaim_interrupted kept it)
        raise CheckpointCorruptError(
            f"{path} is left over and is not a directory of this user; remove it by hand, then save again"
        )
    os.mkdir(path, PRIVATE_DIR)
    return path


def reclaim_interrupted(save_dir: str) -> list[str]:
    """[Note: reclaiming interrupted saves]; the caller holds the save lock. Returns what it did."""
    done = []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        m = _LEFTOVER.fullmatch(name)
        if name == ".latest.tmp":
            if os.path.isfile(path) and not os.path.islink(path):
                os.unlink(path)
                done.append(f"removed {name}")
            continue
        if m is None:
            continue
        if not owned_dir(path):
            log.warning("%s is not a directory of this user: left alone; remove it by hand", path)
            continue
        final = os.path.join(save_dir, m[1])
        if m[2] == "old" and not os.path.lexists(final):
            os.rename(path, final)
            done.append(f"renamed {name} back to {m[1]} (a replace of it was interrupted)")
        else:
            shutil.rmtree(path)
            done.append(f"removed {name}")
    if done:
        fsync_dir(save_dir)
        log.warning("%s: reclaimed what interrupted saves left: %s", save_dir, "; ".join(done))
    return done


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
    if real_dir(final):
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
    """The tag ``latest`` names, None without one; CheckpointCorruptError when it is not a
    regular file (never opened blocking) or names something else than a tag in its folder
    ([Note: checkpoint tags])."""
    path = os.path.join(load_dir, LATEST)
    try:
        raw = read_small(path, _LATEST_MAX_BYTES)
    except FileNotFoundError:
        return None
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise CheckpointCorruptError(
            f"{path} is not text: tiered did not write it; remove it or pass tag=..."
        ) from e
    if not tag:
        return None
    try:
        return check_tag(tag)
    except ValueError as e:
        raise CheckpointCorruptError(
            f"{path} names {tag[:100]!r}, not a tag in {load_dir} ({e}); "
            "latest may only name a checkpoint folder beside it: fix or remove it, or pass tag=..."
        ) from None


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of checkpoint directory `path`; clear errors for missing or half-written ones."""
    mpath = os.path.join(path, MANIFEST)
    try:
        is_dir = real_dir(path)
    except OSError as e:
        raise CheckpointCorruptError(str(e)) from None
    if not is_dir:
        parent, tag = os.path.split(os.path.normpath(path))
        if os.path.isdir(staging_path(parent, tag)):
            raise CheckpointCorruptError(
                f"checkpoint {path} was never completed (only its staging directory "
                f"{staging_path(parent, tag)} exists: the save was interrupted); load another tag"
            )
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist")
    try:
        manifest = json.loads(read_small(mpath, _MANIFEST_MAX_BYTES))
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"checkpoint {path} has no {MANIFEST}: it is half-written or not a tiered checkpoint; load another tag"
        ) from None
    except CheckpointPathError:  # not this user's to read: its permissions, not its bytes
        raise
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"checkpoint manifest {mpath} cannot be read: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{mpath} is not a tiered checkpoint manifest (no format {FORMAT!r})")
    version = manifest.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise CheckpointCorruptError(
            f"{mpath}: format_version {version!r} is not a version number; this tiered reads version "
            f"{FORMAT_VERSION}: the manifest was edited or is corrupt"
        )
    if version in _UNCHECKED_VERSIONS:
        if version not in accepted_old_formats():
            raise CheckpointCorruptError(
                f"{mpath}: format version {version} has no manifest checksum, so an edit of it cannot be "
                f"detected (a version {FORMAT_VERSION} manifest rewritten as version {version} loads "
                f"anything): refused. If an older tiered saved it, load it with {ACCEPT_FORMAT_ENV}={version} "
                "in the environment, then save it again to get a checksum"
            )
        log.warning(
            "%s: format version %s has no manifest checksum, so an edit of it cannot be detected "
            "(accepted: %s=%s); save the checkpoint again to get one",
            mpath,
            version,
            ACCEPT_FORMAT_ENV,
            version,
        )
    elif version != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{mpath}: format_version {version!r}; this tiered reads version {FORMAT_VERSION}"
        )
    elif manifest.get(MANIFEST_CHECKSUM) != manifest_digest(manifest):
        raise CheckpointCorruptError(
            f"checkpoint manifest {mpath} fails its checksum ({MANIFEST_CHECKSUM} "
            f"{manifest.get(MANIFEST_CHECKSUM)!r}, computed {manifest_digest(manifest)!r}): it was edited "
            "or is corrupt; load another checkpoint (tiered.checkpoint.find_latest_valid)"
        )
    _check_file_names(mpath, manifest.get("files"))
    return manifest


def accepted_old_formats() -> tuple[int, ...]:
    """The older format versions the user asked to read ([Note: manifest checksum]):
    ``TIERED_ACCEPT_CHECKPOINT_FORMAT=1`` (a comma-separated list); none by default."""
    text = os.environ.get(ACCEPT_FORMAT_ENV, "").strip()
    if not text:
        return ()
    versions = []
    for part in text.split(","):
        try:
            v = int(part)
        except ValueError:
            v = -1
        if v not in _UNCHECKED_VERSIONS:
            raise ConfigError(
                f"{ACCEPT_FORMAT_ENV}={text!r}: {part.strip()!r} is not an older checkpoint format version "
                f"this tiered can read ({', '.join(map(str, _UNCHECKED_VERSIONS))}); unset it or write 1"
            )
        versions.append(v)
    return tuple(versions)


def _check_file_names(mpath: str, files: Any) -> None:
    """Every file a manifest lists is a plain name inside its checkpoint folder."""
    if not isinstance(files, dict):
        raise CheckpointCorruptError(f"{mpath}: 'files' is not a mapping of file names to records")
    for name in files:
        if not isinstance(name, str) or not name or name.startswith(".") or _BAD_TAG_CHARS.search(name):
            raise CheckpointCorruptError(f"{mpath} lists a file {name!r} outside its checkpoint folder")


def resolve(load_dir: str, tag: str | None) -> str:
    """The checkpoint directory `tag` names under `load_dir`, or the one ``latest`` names."""
    lstat_or_none(load_dir)  # a folder on the way this user cannot enter is named so, not "missing"
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
        lstat_or_none(os.path.join(path, MANIFEST))  # a folder this user cannot enter is named so
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
    except PermissionError:
        raise permission_denied(save_dir) from None
    for name in names:
        path = os.path.join(save_dir, name)
        if name.startswith(".") or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            m = read_manifest(path)
            for fname, rec in m["files"].items():
                fpath = os.path.join(path, fname)
                if verify:
                    verify_file(fpath, rec)
                elif os.path.getsize(fpath) != rec["bytes"]:
                    raise CheckpointCorruptError(fpath)
        except CheckpointPathError:  # unreadable here: it may be the newest, so never skipped silently
            raise
        except (CheckpointCorruptError, CheckpointNotFoundError, OSError, KeyError, TypeError) as e:
            log.info("skipping %s: %s", path, e)
            continue
        counters = m.get("training") or m.get("counters") or {}  # an engine's, or save_tensors' caller's
        key = (int(counters.get("global_steps", -1)), os.path.getmtime(os.path.join(path, MANIFEST)), name)
        if best is None or key > best:
            best = key
    return None if best is None else best[2]
