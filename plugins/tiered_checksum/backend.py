"""ChecksumBackend: any backend, opened from a nested spec, with a digest stored per object.

[Note: digests beside the data]
The tier manager already checks what it reads back against the digests it recorded when it wrote
([Note: partition checksums] in tiered.tiers.checksum), but those live in the process: a
persistent tier reopened by a new process, a store shared by tools, or a backend used directly has
no record to compare with. This wrapper stores, next to each object, a small sidecar (the byte
length and the xxh3_64 of the bytes) in the same inner backend, and verifies both on every read.

Data and digest are two objects, each atomic in the inner backend, so a write is three steps: the
sidecar is rewritten to hold the new digest AND the one it held (the object's current version),
then the data is written, then the sidecar is rewritten with the new digest alone. A crash or a
cancellation at any point leaves data that matches one of the digests recorded: the old version
before the data commit, the new one after, so the contract's "old or new, never a mix" holds and
no false alarm is raised. The price: during a write's own window a lost data write (the store
acknowledging bytes it never kept) would read back as the old version unnoticed; the third step
closes that window. Within one process, a per-key lock keeps a read from pairing one version's
data with another's digest. An object without a sidecar (written without this layer) is refused,
not trusted.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import defaultdict
from typing import Any

import torch
import xxhash

from tiered.errors import StorageCorruptError, StorageKeyError, StoredSizeError
from tiered.storage.base import MAX_KEY_CHARS, StorageBackend, check_key, check_out_size, tensor_bytes
from tiered.storage.nested import WrappingBackend

log = logging.getLogger(__name__)

_ENTRY = struct.Struct("<QQ")  # byte length, xxh3_64
_SIDECAR_SIZES = (_ENTRY.size, 2 * _ENTRY.size)  # the current digest, or the new one and the old
_SUFFIX = ".xxh3"


def _digest(flat: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(flat.numpy().data) if flat.numel() else xxhash.xxh3_64_intdigest(b"")


def _host_bytes(key: str, t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes, after the key and device checks every data method starts with."""
    check_key(key)
    flat = tensor_bytes(t, what=f"key {key!r}")
    if flat.device.type != "cpu":
        raise ValueError(f"backend 'checksum', key {key!r}: pass a CPU tensor (got {flat.device})")
    return flat


def _pack(entries: list[tuple[int, int]]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(_ENTRY.pack(*e) for e in entries)), dtype=torch.uint8)


def sidecar_key(key: str) -> str:
    """The inner key holding `key`'s digest: `key` + ".xxh3", or for a key too long to take the
    suffix, a fixed-length name derived from the key (so every valid key has a sidecar)."""
    if len(key) + len(_SUFFIX) <= MAX_KEY_CHARS:
        return key + _SUFFIX
    return f"xxh3-{xxhash.xxh3_128_hexdigest(key.encode())}{_SUFFIX}"


class ChecksumBackend(WrappingBackend):
    """``{"type": "checksum", "inner": SPEC}``. See [Note: digests beside the data]."""

    name = "checksum"

    def __init__(self, inner: dict[str, Any] | str | StorageBackend, **options: Any) -> None:
        self.open_inner(inner, options)
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.verified_bytes = 0
        self.mismatches = 0

    def stats(self) -> dict[str, int]:
        return {"verified_bytes": self.verified_bytes, "mismatches": self.mismatches}

    async def write(self, key: str, tensor: torch.Tensor) -> None:
        flat = _host_bytes(key, tensor)
        async with self._locks[key]:
            new = (flat.numel(), await self.bridge.run(_digest, flat))
            try:
                old = (await self._recorded(key))[:1]
            except (StorageKeyError, StorageCorruptError):
                old = []  # nothing (trustworthy) stored yet: only the new version may be read back
            await self.inner.write(sidecar_key(key), _pack([new, *old]))
            await self.inner.write(key, tensor)
            if old:
                await self.inner.write(sidecar_key(key), _pack([new]))

    async def read(self, key: str, out: torch.Tensor) -> None:
        flat = _host_bytes(key, out)
        async with self._locks[key]:
            recorded = await self._recorded(key)
            sizes = {length for length, _ in recorded}
            if flat.numel() not in sizes:
                check_out_size(key, recorded[0][0], flat.numel(), where=self.locate(key))
            try:
                await self.inner.read(key, out)
            except StoredSizeError as exc:  # the digest says the caller's size is right: the object is not
                raise StorageCorruptError(
                    f"backend 'checksum': key {key!r} at {self.locate(key)} is truncated or overwritten: "
                    f"{flat.numel()} bytes were written, the store holds {exc.stored_nbytes}; it is corrupt "
                    "and was not used - restore it from a checkpoint"
                ) from exc
            got = await self.bridge.run(_digest, flat)
        self.verified_bytes += flat.numel()
        if (flat.numel(), got) not in recorded:
            self.mismatches += 1
            want = " or ".join(f"{d:#018x}" for n, d in recorded if n == flat.numel())
            raise StorageCorruptError(
                f"backend 'checksum': key {key!r} at {self.locate(key)} is corrupt: xxh3_64 "
                f"{got:#018x} read, {want} written; the bytes are not the ones stored "
                "(a bad sector, a torn or foreign write) and were not used - restore them from a checkpoint"
            )

    async def _recorded(self, key: str) -> list[tuple[int, int]]:
        """The (byte length, digest) versions `key` may hold, newest first; StorageKeyError naming
        `key` if it is absent, StorageCorruptError if its digest is missing or damaged."""
        side_key = sidecar_key(key)
        for size in _SIDECAR_SIZES:
            side = torch.empty(size, dtype=torch.uint8)
            try:
                await self.inner.read(side_key, side)
            except StorageKeyError:
                if not await self.inner.exists(key):
                    raise StorageKeyError(f"backend 'checksum': key {key!r} not found") from None
                raise StorageCorruptError(
                    f"backend 'checksum': key {key!r} at {self.locate(key)} has no recorded digest "
                    f"({side_key!r} is missing): written without the checksum layer, or its digest "
                    "was lost; it is not trusted - write it again through this backend"
                ) from None
            except StoredSizeError as exc:
                if exc.stored_nbytes in _SIDECAR_SIZES:
                    continue  # the other layout
                raise StorageCorruptError(
                    f"backend 'checksum': the recorded digest of key {key!r} ({side_key!r}) is "
                    f"damaged ({exc}); the object is not trusted - restore it from a checkpoint"
                ) from exc
            raw = side.numpy().tobytes()
            return [_ENTRY.unpack_from(raw, off) for off in range(0, size, _ENTRY.size)]
        raise AssertionError("unreachable: a sidecar has one of two sizes")

    async def delete(self, key: str) -> None:
        check_key(key)
        async with self._locks[key]:
            await self.inner.delete(key)
            try:
                await self.inner.delete(sidecar_key(key))
            except StorageKeyError:
                log.debug("checksum: key %r had no digest to delete", key)

    async def exists(self, key: str) -> bool:
        check_key(key)
        return await self.inner.exists(key)


__all__ = ["ChecksumBackend", "sidecar_key"]
