"""One checkpoint save on disk: a staging directory, streamed files, the manifest, publication.

The engine's save (tiered/checkpoint/engine_state.py) and `save_tensors` both go through
`CheckpointWriter`, so every checkpoint gets the same guarantees: see [Note: atomic checkpoint],
[Note: checkpoint save lock], [Note: manifest checksum] and [Note: streamed safetensors].
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from tiered.checkpoint import directory as d
from tiered.checkpoint.lock import SaveLock
from tiered.checkpoint.paths import check_save_dir
from tiered.checkpoint.stream import StreamWriter, TensorSpec, chunks_of, file_bytes, verify_file
from tiered.errors import CheckpointCorruptError, CheckpointSpaceError

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 16 << 20


class CheckpointWriter:
    """Write the files of checkpoint `tag` under `save_dir`, then `commit` (or `abort`).

    `owner` is the process that creates and publishes the directory (rank 0); other ranks only
    `write_file` into the staging directory once the owner prepared it. The owner holds the
    folder's save lock from `begin` to the end of `commit` or `abort` ([Note: checkpoint save
    lock]), waiting at most `lock_timeout_s` for another saver."""

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        tag: str,
        *,
        owner: bool = True,
        lock_timeout_s: float | None = None,
    ) -> None:
        self.save_dir = os.fspath(save_dir)
        self.tag = d.check_tag(tag)
        self.owner = owner
        self.staging = d.staging_path(self.save_dir, self.tag)
        self.files: dict[str, dict[str, Any]] = {}
        self._lock = SaveLock(self.save_dir, lock_timeout_s)

    def begin(self, need_bytes: int) -> None:
        """(Owner) take the save lock; check the free space for `need_bytes`; (owner) create an
        empty staging directory."""
        check_save_dir(self.save_dir)  # [Note: private checkpoints]
        if self.owner:
            self._lock.acquire()
        try:
            d.check_free_space(self.save_dir, need_bytes)
            if self.owner:
                d.prepare_staging(self.save_dir, self.tag)
        except BaseException:
            self._lock.release()
            raise

    def write_file(
        self,
        filename: str,
        specs: list[TensorSpec],
        chunks: Iterable[torch.Tensor],
        metadata: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Stream one safetensors file: `chunks` yields host tensors, in spec order, whose bytes
        add up to each tensor in turn. Returns (and remembers) the file's manifest record."""
        path = os.path.join(self.staging, filename)
        w = StreamWriter(path, specs, dict(metadata) if metadata else None)
        try:
            for c in chunks:
                w.append(c)
            rec = w.finish()
        finally:
            w.close()
        self.files[filename] = rec
        return rec

    def commit(
        self,
        manifest: dict[str, Any],
        files: Mapping[str, dict[str, Any]] | None = None,
        *,
        save_latest: bool = True,
    ) -> str:
        """Write manifest.json (with every file's record: this writer's and `files`, those other
        ranks wrote), publish the directory and (`save_latest`) move ``latest``. Owner only."""
        if not self.owner:
            raise RuntimeError("CheckpointWriter.commit: only the owning rank publishes a checkpoint")
        body = dict(manifest)
        body["format"] = d.FORMAT
        body["format_version"] = d.FORMAT_VERSION
        body["tag"] = self.tag
        body.setdefault("created_unix_s", time.time())
        body["files"] = {**self.files, **(files or {})}
        body.pop(d.MANIFEST_CHECKSUM, None)
        body[d.MANIFEST_CHECKSUM] = d.manifest_digest(body)  # [Note: manifest checksum]
        mpath = os.path.join(self.staging, d.MANIFEST)
        if not self._lock.held:
            raise RuntimeError("CheckpointWriter.commit before begin: the save lock is not held")
        try:
            try:
                d.write_json_durably(mpath, body)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise CheckpointSpaceError(
                        errno.ENOSPC,
                        f"no space left on device while writing {mpath}: free space there or save elsewhere",
                        mpath,
                    ) from e
                raise
            final = d.publish(self.save_dir, self.tag, self.staging)
            check_published(final, body)
            if save_latest:
                d.write_latest(self.save_dir, self.tag)
        finally:
            self._lock.release()
        log.info("checkpoint %s written (%d files)", final, len(body["files"]))
        return final

    def abort(self) -> None:
        """Remove the staging directory; the previous checkpoint and ``latest`` are untouched."""
        try:
            if self.owner and os.path.lexists(self.staging) and not os.path.islink(self.staging):
                shutil.rmtree(self.staging, ignore_errors=True)
        finally:
            self._lock.release()


def check_published(path: str, body: Mapping[str, Any]) -> None:
    """Before ``latest`` moves: checkpoint `path` reads back as the manifest just written (its
    checksum) and holds every file it lists at its recorded size. The bytes themselves were
    hashed on their way out ([Note: streamed safetensors]); reading them all again would double
    the I/O of every save, so only a load (or find_latest_valid) reads them."""
    m = d.read_manifest(path)
    if m.get(d.MANIFEST_CHECKSUM) != body[d.MANIFEST_CHECKSUM]:
        raise CheckpointCorruptError(f"checkpoint {path} changed while it was published (another writer?)")
    for fname, rec in m["files"].items():
        fpath = os.path.join(path, fname)
        st = os.lstat(fpath)
        if not stat.S_ISREG(st.st_mode) or st.st_size != rec["bytes"]:
            raise CheckpointCorruptError(
                f"checkpoint file {fpath} is not the {rec['bytes']}-byte file just written; 'latest' not moved"
            )


def save_tensors(
    save_dir: str | os.PathLike[str],
    tag: str,
    tensors: Mapping[str, torch.Tensor],
    manifest: dict[str, Any] | None = None,
    *,
    filename: str = "tensors.safetensors",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> str:
    """A checkpoint of plain host tensors, with the guarantees of [Note: atomic checkpoint]."""
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    w = CheckpointWriter(save_dir, tag)
    w.begin(file_bytes(specs))
    try:
        w.write_file(filename, specs, (c for t in tensors.values() for c in chunks_of(t.cpu(), chunk_bytes)))
        return w.commit(dict(manifest or {}))
    except BaseException:
        w.abort()
        raise


def load_tensors(
    load_dir: str | os.PathLike[str], tag: str | None = None
) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """(path, manifest, tensors) of a checkpoint written by `save_tensors`, every file verified."""
    from safetensors import safe_open

    path = d.resolve(os.fspath(load_dir), tag)
    manifest = d.read_manifest(path)
    out: dict[str, torch.Tensor] = {}
    for fname, rec in manifest["files"].items():
        fpath = os.path.join(path, fname)
        verify_file(fpath, rec)
        with safe_open(fpath, "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return path, manifest, out
