"""Where a striped object's bytes live: stripe placement, member key names, the stripe record.

[Note: stripe layout]
An object of N bytes over n members is cut into stripes of S bytes (the last one shorter), where
S is the larger of ``stripe_bytes`` and N/n rounded up to a page (the lcm of 4 KiB and the
members' alignment): an object of at most ``stripe_bytes`` stays whole on one member, a larger
one is cut into one stripe per member (fewer when ``stripe_bytes`` is the larger). Stripe i is
stored on member ``(home + i) % n`` as an object of its own, where ``home = crc32(key) % n``
spreads small objects (a single stripe) and each object's first stripe over all members. A stripe
is a contiguous slice of the caller's tensor, so it is written from and read into the caller's
memory with no copy, page aligned where the tensor is.

Why at most one stripe per member per object: a read or write is always of the whole object, so
every member carries an equal share of it either way, and each stripe a member stores is one more
object with its own per-object cost (a file opened, sized and closed: three or four calls through
the I/O bridge). Over two directories of one disk, on the training pattern (16 x 64 MiB), writes
ran at 0.64x of one directory with 1 MiB stripes, 0.96x with 8 MiB and 1.03x with 32 MiB (one
stripe per member). The record keeps the S it was written with, so objects written with another
layout (another stripe size, or the fixed-size stripes of before) read back unchanged.

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

[Note: stripe scratch mode]
A fresh generation per write costs what swap files exist to avoid: every write creates its stripe
objects anew (files allocated, O_DIRECT into fresh extents), writes a record and deletes the old
stripes: over two directories on one disk that wrote at 0.36-0.63x of one directory. Over members
in a declared scratch mode (the nvme backend's ``atomic=False``, what the engine's swap tiers
use) the commit protects nothing the members promise themselves: a member's own failed or
cancelled write may leave a mix. So a stripe set whose members are all scratch (or one opened with
``"atomic": false``) is scratch too: a write whose layout is unchanged (member count, stripe size
and object size equal to the record's) rewrites the record's stripes in place, under the same
generation, with no record write and nothing deleted; any other write (the first, a new size or
stripe size) still goes through a fresh generation and the commit. What it keeps:

- a read never sees a mix: the per-key lock orders a key's reads after its writes, a cancelled
  in-place write runs every stripe write to its end before it raises (`finish_all`: the new object
  whole), and a failed one drops the key (record, then stripes) instead of leaving a mix, so a
  later read is an error naming the key, never data;
- a crash during an in-place write may leave the stripes mixed, as a member's own in-place file
  would: scratch files are scratch (the engine's are in private swap directories, gone with the
  process). ``"atomic": true`` keeps the fresh generation per write over any members.
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


PAGE_BYTES = 4096


def object_stripe_bytes(nbytes: int, stripe_bytes: int, members: int, boundary: int = PAGE_BYTES) -> int:
    """The stripe size of an `nbytes` object: at least `stripe_bytes`, at most one stripe per
    member, cut on a multiple of `boundary` ([Note: stripe layout])."""
    share = -(-nbytes // members)
    return max(stripe_bytes, -(-share // boundary) * boundary)


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

    def holds(self, members: int, stripe_bytes: int, nbytes: int) -> bool:
        """Whether an object of this layout has exactly this record's stripes (so its stripe
        objects can be rewritten in place: [Note: stripe scratch mode])."""
        return (self.members, self.stripe_bytes, self.nbytes) == (members, stripe_bytes, nbytes)

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
