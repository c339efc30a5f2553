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
"""

from __future__ import annotations

import torch
import xxhash

from tiered.errors import StorageCorruptError
from tiered.tiers.error_context import mark

ALGORITHM = "xxh3_64"


def digest_of(t: torch.Tensor) -> int:
    """xxh3_64 of `t`'s bytes (a copy to host first for a device tensor)."""
    b = t.detach().reshape(-1).view(torch.uint8)
    if b.device.type != "cpu":
        b = b.cpu()
    return xxhash.xxh3_64_intdigest(b.numpy().data)


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
