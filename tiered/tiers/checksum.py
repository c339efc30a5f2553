"""Checksums of the bytes written to non-memory tiers, and their check on the way back.

[Note: partition checksums]
Every write of a partition to a tier that is not memory-like (nvme files, a swap folder, a
stripe, a tier of the user's) records the 64-bit xxh3 digest of the bytes written
(`Partition.checksum`); every read back recomputes it over the buffer it filled, before the copy
is marked readable (`Transfers.read_into`, the one place a tier's bytes come back into memory).
A mismatch, or an object shorter or longer than the partition, is a StorageCorruptError naming
partition, tier, backend, file (or key) and both digests, and the load fails: the buffer is never
handed to training. xxh3 was chosen over crc32c by measurement on partition-sized buffers
(1 MiB: xxh3 ~35 GB/s, crc32c ~21 GB/s, zlib crc32 ~2.4 GB/s; both fast ones memory-bound at
~11-12 GB/s over 64 MiB), and xxhash is already a core dependency (checkpoint files use it).
Off with ``"tiered": {"verify_checksums": false}``.

The digest of a partition of one piece (`PIECE_BYTES`, 8 MiB) is the xxh3 of its bytes; of a
larger one, the xxh3 of its pieces' digests (little-endian u64s, in order). So the pieces of a
large partition hash in parallel on the loop's bridge (`Transfers.checksum`; xxhash releases the
GIL over 64 KiB) and its read is checked in a fraction of one thread's time: a 4 GB partition
takes ~0.3 s on one thread at memory bandwidth, which would sit between the read and training. The cost on the step
benchmark is in benchmarks/RESULTS.md ("Checksum cost").
"""

from __future__ import annotations

import struct

import torch
import xxhash

from tiered.errors import StorageCorruptError
from tiered.tiers.error_context import mark

ALGORITHM = "xxh3_64"
PIECE_BYTES = 8 << 20
"""The bytes hashed by one call; see [Note: partition checksums]."""
SERIAL_PIECES = 4
"""Up to this many pieces (32 MiB, ~2.5 ms of one thread) are hashed by one bridge call: below
it the threads' hand-offs cost more than the parallelism saves on a busy 2-core host (measured:
17 MiB 1.3 vs 1.5 ms, 64 MiB 5.3 vs 6.2 ms, 512 MiB 292 vs 114 ms, one thread vs parallel)."""


def host_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a flat uint8 host tensor: a view of a contiguous host tensor, else a copy."""
    b = t.detach().reshape(-1).view(torch.uint8)
    return b if b.device.type == "cpu" else b.cpu()


def pieces(nbytes: int) -> list[tuple[int, int]]:
    """(offset, length) of the pieces hashed separately; one piece for an empty tensor too."""
    if nbytes <= PIECE_BYTES:
        return [(0, nbytes)]
    return [(o, min(PIECE_BYTES, nbytes - o)) for o in range(0, nbytes, PIECE_BYTES)]


def piece_digest(b: torch.Tensor, offset: int, length: int) -> int:
    """xxh3_64 of ``b[offset:offset + length]`` (no copy: a memoryview of the tensor's storage)."""
    return xxhash.xxh3_64_intdigest(b[offset : offset + length].numpy().data)


def combine(digests: list[int]) -> int:
    """The partition's digest from its pieces' digests, in order."""
    if len(digests) == 1:
        return digests[0]
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))


class StreamingDigest:
    """A partition's digest over its bytes fed in order in chunks of any size (a checkpoint's
    file-to-file copy): the same number as `digest_of` on the whole partition."""

    def __init__(self, nbytes: int) -> None:
        self._single = nbytes <= PIECE_BYTES
        self._hash = xxhash.xxh3_64()
        self._in_piece = 0
        self._pieces: list[int] = []

    def update(self, chunk: torch.Tensor) -> None:
        data = host_bytes(chunk).numpy().data
        if self._single:
            self._hash.update(data)
            return
        while len(data):
            take = min(PIECE_BYTES - self._in_piece, len(data))
            self._hash.update(data[:take])
            self._in_piece += take
            data = data[take:]
            if self._in_piece == PIECE_BYTES:
                self._pieces.append(self._hash.intdigest())
                self._hash, self._in_piece = xxhash.xxh3_64(), 0

    def intdigest(self) -> int:
        if self._single:
            return self._hash.intdigest()
        tail = [self._hash.intdigest()] if self._in_piece else []
        return combine(self._pieces + tail)


def digest_of(t: torch.Tensor) -> int:
    """The digest of `t`'s bytes on this thread (`Transfers.checksum` hashes the pieces in
    parallel and gets the same number)."""
    b = host_bytes(t)
    return combine([piece_digest(b, o, n) for o, n in pieces(b.numel())])


def check_digest(got: int, want: int, context: str, dst: str, location: str) -> None:
    """StorageCorruptError naming the copy when the bytes read are not the bytes written."""
    if got != want:
        raise mark(
            StorageCorruptError(
                f"{context}: checksum mismatch reading into tier {dst!r} from {location} "
                f"({ALGORITHM} {got:#018x} read, {want:#018x} written); the stored copy is corrupt "
                "(a bad sector, or something else wrote the file) and was not used - restore it from "
                "a checkpoint (tiered.load_checkpoint / --resume)"
            )
        )


def truncated(context: str, dst: str, location: str, stored: int | None, want: int) -> BaseException:
    """The StorageCorruptError of a stored object whose size is not the partition's."""
    size = "a different size" if stored is None else f"{stored} bytes"
    return mark(
        StorageCorruptError(
            f"{context}: stored copy at {location} has {size} but the partition has {want} bytes "
            f"(reading into tier {dst!r}); the file is truncated or was overwritten - it is corrupt and "
            "was not used; restore it from a checkpoint (tiered.load_checkpoint / --resume)"
        )
    )
