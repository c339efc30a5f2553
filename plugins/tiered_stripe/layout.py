"""Where a striped object's bytes live: stripe placement, member key names, the stripe record.

[Note: stripe layout]
An object of N bytes is cut into stripes of ``stripe_bytes`` (the last one shorter); stripe i is
stored on member ``(home + i) % n`` as an object of its own, where ``home = crc32(key) % n`` spreads
small objects (a single stripe) and each object's first stripe over all members. A stripe is a
contiguous slice of the caller's tensor, so it is written from and read into the caller's memory
with no copy (and stays page aligned when ``stripe_bytes`` is a multiple of the page size).

[Note: stripe commit]
Writes must stay atomic per key across members, which no member can promise for another. So every
write stores its stripes under a fresh random *generation* and only then commits by writing the
key's stripe record on the home member (one small write, atomic by that member's own contract):
magic, version, member count, stripe size, object size, generation, crc32. A reader follows the
record, so it sees the old object or the new one, never a mix; the old generation's stripes are
deleted after the commit, a failed or cancelled write deletes its own. A crash between the two
leaves unreferenced stripes behind (garbage, never data). Member keys are ``m-<key>`` (the record)
and ``d<generation>x<i>-<key>`` (stripe i): prefixes keep every user key's names apart from every
other's, and the file of the record still carries the key's name for a human.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from tiered.errors import StorageIOError

MAGIC = b"tstripe1"
VERSION = 1
_RECORD = struct.Struct("<8sIIQQQ")  # magic, version, members, stripe_bytes, nbytes, generation
RECORD_BYTES = _RECORD.size + 4  # + crc32 of the fields


def home_member(key: str, members: int) -> int:
    """The member holding `key`'s record and first stripe (stable across processes: not hash())."""
    return zlib.crc32(key.encode()) % members


def record_key(key: str) -> str:
    return f"m-{key}"


def stripe_key(key: str, generation: int, index: int) -> str:
    return f"d{generation:016x}x{index}-{key}"


def stripes(nbytes: int, stripe_bytes: int, members: int, home: int) -> list[tuple[int, int, int, int]]:
    """(stripe index, member, start byte, end byte) for every stripe of an `nbytes` object."""
    return [
        (i, (home + i) % members, start, min(start + stripe_bytes, nbytes))
        for i, start in enumerate(range(0, nbytes, stripe_bytes))
    ]


@dataclass(frozen=True)
class StripeRecord:
    """The commit record of one key. See [Note: stripe commit]."""

    members: int
    stripe_bytes: int
    nbytes: int
    generation: int

    def pack(self) -> torch.Tensor:
        body = _RECORD.pack(MAGIC, VERSION, self.members, self.stripe_bytes, self.nbytes, self.generation)
        raw = body + struct.pack("<I", zlib.crc32(body))
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    @classmethod
    def unpack(cls, buf: torch.Tensor, *, where: str) -> StripeRecord:
        raw = bytes(buf.numpy().tobytes())
        body, (crc,) = raw[: _RECORD.size], struct.unpack("<I", raw[_RECORD.size :])
        magic, version, members, stripe_bytes, nbytes, generation = _RECORD.unpack(body)
        if magic != MAGIC or zlib.crc32(body) != crc:
            raise StorageIOError(
                f"{where}: the stripe record is corrupt (magic {magic!r}, crc32 {zlib.crc32(body):#010x} vs "
                f"stored {crc:#010x}); the object is lost - restore it from a checkpoint"
            )
        if version != VERSION:
            raise StorageIOError(
                f"{where}: stripe record version {version}, this tiered reads version {VERSION}"
            )
        return cls(members, stripe_bytes, nbytes, generation)
