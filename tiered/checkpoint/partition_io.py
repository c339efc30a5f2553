"""Reading and writing one partition's bytes through the TierManager, for checkpoints.

[Note: checkpoint partition I/O]
A save reads each partition where its newest bytes already are. A memory-like copy (a host tier
first: no device copy) is sliced into chunks in place; a copy on a CUDA device is copied to the
host one bounded chunk at a time. When the only newest copy is the home's stored object and the
home backend says where it lies in a plain file (`StorageBackend.local_file`: nvme, aiofiles; an
nvme swap file at its shift with its block padding, or a slot of the slab), those bytes are
streamed into the checkpoint through the chunk pipeline ([Note: checkpoint chunk pipeline]),
the home held for it ([Note: direct home I/O]) and its bytes checked against the digest the tier
recorded when it wrote them ([Note: partition checksums]): a corrupt swap file fails the save,
naming partition and file, instead of being copied into a checkpoint. Only a home without a local
file (a stripe, a user's object store) is still fetched whole into the "cpu" tier and evicted
again afterwards (a clean copy: free).

A load fills a partition from its pieces in the checkpoint files, chunk by chunk, in partition
order (a rank's slice of a tensor spans byte ranges of one or more files when the world size
changed; the gaps are padding, zero). Into a memory-like home it copies the chunks straight into
the resident copy the ZeRO-3 home views alias ([Note: home views]); into a file home it writes a
new file of exactly the bytes beside the stored one, with its digest computed on the way, and
commits it (`TierManager.commit_home`: the backend adopts the file, `StorageBackend.adopt_file`);
else into a "cpu" copy it then evicts, which writes it home. Either
way every other copy (a gathered or prefetched one on the GPU) goes stale, so nothing old is read
afterwards.
"""

from __future__ import annotations

import bisect
import contextlib
import os
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiered.checkpoint.pipeline import ChunkPipeline, Fill, open_direct, pread_exact, pwrite_all
from tiered.checkpoint.stream import chunks_of
from tiered.errors import StorageCorruptError
from tiered.storage.base import LocalFile
from tiered.storage.files import remove_quietly, temp_path
from tiered.tiers.checksum import StreamingDigest

_STAGING_TIER = "cpu"


def _memory_like(tm: Any, tier: str) -> bool:
    return bool(tm.tier(tier).backend.capabilities.memory_like)


def _host_device(tm: Any, tier: str) -> bool:
    return str(tm.tier(tier).backend.capabilities.device) == "cpu"


def _home_file(tm: Any, part: Any) -> LocalFile | None:
    """Where `part`'s home bytes lie in a plain file, where its home keeps them so (`local_file`)."""
    if _memory_like(tm, part.home):
        return None
    local_file = getattr(tm.tier(part.home).backend, "local_file", None)
    return local_file(part.name) if local_file is not None else None


def read_tier(tm: Any, part: Any) -> str:
    """The memory-like tier a save reads `part` from. See [Note: checkpoint partition I/O]."""
    valid = [t for t in part.valid_in() if _memory_like(tm, t)]
    valid.sort(key=lambda t: (not _host_device(tm, t), t != part.home))
    return valid[0] if valid else _STAGING_TIER


@contextmanager
def resident(tm: Any, part: Any) -> Iterator[torch.Tensor]:
    """`part`'s newest bytes as a (pinned) resident tensor, released (and evicted where this
    fetched it) on exit. See [Note: checkpoint partition I/O]."""
    tier = read_tier(tm, part)
    was_resident = part.state(tier).resident
    t = tm.fetch(part, tier).result()
    try:
        yield t
    finally:
        tm.release(part, tier)
        if not was_resident and tier != part.home:
            tm.evict(part, tier).result()


def read_chunks(
    tm: Any, part: Any, pipe: ChunkPipeline, staging: torch.Tensor | None = None
) -> Iterator[torch.Tensor]:
    """`part`'s newest bytes, in order, as host tensors of its dtype of at most
    ``pipe.chunk_bytes``; `staging` (a host buffer of that size) for a copy on a CUDA device.
    See [Note: checkpoint partition I/O]."""
    if _home_file(tm, part) is not None and not any(_memory_like(tm, t) for t in part.valid_in()):
        claim = tm.claim_home(part, write=False)
        if claim is not None:
            try:
                loc = _home_file(tm, part)  # asked again under the claim: a write may have moved it
                if loc is not None:
                    yield from _file_chunks(tm, part, loc, claim.checksum, pipe)
                    return
            finally:
                tm.release_home(claim)
    with resident(tm, part) as t:
        yield from chunks_of(t, pipe.chunk_bytes, staging)


def _where(tm: Any, part: Any, loc: LocalFile) -> str:
    at = f" at offset {loc.offset}" if loc.offset else ""
    return (
        f"partition {part.name!r} in tier {part.home!r} (backend {tm.tier(part.home).backend.name!r}, "
        f"file {loc.path!r}{at})"
    )


def _file_chunks(
    tm: Any, part: Any, loc: LocalFile, want: int | None, pipe: ChunkPipeline
) -> Iterator[torch.Tensor]:
    # O_DIRECT where the payload starts on a block (a shifted one is read buffered: pread_exact
    # drops O_DIRECT for the descriptor at the first refused call)
    fd, direct = open_direct(loc.path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if loc.nbytes != part.nbytes or size < loc.offset + loc.nbytes:
            raise StorageCorruptError(
                f"checkpoint save: {_where(tm, part, loc)} has {max(0, min(loc.nbytes, size - loc.offset))} "
                f"bytes but the partition has {part.nbytes}; the stored copy is truncated or was "
                "overwritten - the checkpoint was not written (the previous one stays 'latest'); restore "
                "from a checkpoint"
            )
        h = StreamingDigest(part.nbytes)

        def fill(buf: torch.Tensor, off: int, n: int) -> None:
            pread_exact(fd, buf, loc.offset + off, n, direct=direct, what=_where(tm, part, loc))

        with contextlib.closing(pipe.chunks(part.nbytes, fill)) as chunks:
            for buf, _, n in chunks:
                h.update(buf[:n])
                yield buf[:n].view(part.dtype)
        got = h.intdigest()
        if want is not None and got != want:
            raise StorageCorruptError(
                f"checkpoint save: {_where(tm, part, loc)} fails its checksum (xxh3_64 {got:#018x} "
                f"read, {want:#018x} written): the stored copy is corrupt (a bad sector, or something "
                "else wrote the file) and was not copied; the checkpoint was not written (the previous "
                "one stays 'latest'); restore from a checkpoint"
            )
    finally:
        os.close(fd)


# ---- load ----------------------------------------------------------------------------------
Chunks = Generator[tuple[torch.Tensor, int, int], None, None]
"""What `ChunkPipeline.chunks` yields: (buffer, offset in the partition, length)."""


@dataclass(frozen=True)
class Segment:
    """Bytes [dst, dst + nbytes) of a partition come from file descriptor `fd` at offset `src`."""

    dst: int
    nbytes: int
    fd: int
    src: int


def _filler(segments: Sequence[Segment], what: str) -> Fill:
    """fill(buf, off, n) for the chunk pipeline: the segments' bytes in [off, off + n), zero
    between them (padding)."""
    segs = sorted(segments, key=lambda s: s.dst)
    starts = [s.dst for s in segs]

    def fill(buf: torch.Tensor, off: int, n: int) -> None:
        end, cur = off + n, off
        i = max(0, bisect.bisect_right(starts, off) - 1)
        while i < len(segs) and segs[i].dst < end:
            s = segs[i]
            lo, hi = max(cur, s.dst), min(end, s.dst + s.nbytes)
            if hi > lo:
                if lo > cur:
                    buf[cur - off : lo - off].zero_()
                pread_exact(s.fd, buf[lo - off :], s.src + lo - s.dst, hi - lo, direct=False, what=what)
                cur = hi
            i += 1
        if cur < end:
            buf[cur - off : n].zero_()

    return fill


def load_partition(tm: Any, part: Any, segments: Sequence[Segment], pipe: ChunkPipeline, what: str) -> None:
    """Replace every byte of `part` with its `segments` (zero elsewhere), chunk by chunk. See
    [Note: checkpoint partition I/O]."""
    fill_partition(tm, part, _filler(segments, what), pipe)


def fill_partition(tm: Any, part: Any, fill: Fill, pipe: ChunkPipeline) -> None:
    """Replace every byte of `part` with what `fill` puts into each chunk (`load_partition`, or
    decoded moments: tiered/checkpoint/decode_load.py)."""
    home = part.home
    if _memory_like(tm, home):
        t = tm.fetch(part, home).result()
        try:
            _copy_chunks(t, pipe.chunks(part.nbytes, fill))
            tm.mark_dirty(part, home)  # other copies (a gathered one) are stale now
        finally:
            tm.release(part, home)
        return
    loc = _home_file(tm, part)
    if loc is not None:
        claim = tm.claim_home(part, write=True)
        assert claim is not None  # a write claim always succeeds (or times out)
        _replace_file(tm, part, claim, Path(loc.path).parent, pipe, fill)
        return
    t = tm.allocate(part, _STAGING_TIER).result()
    try:
        _copy_chunks(t, pipe.chunks(part.nbytes, fill))
    finally:
        tm.release(part, _STAGING_TIER)
    tm.evict(part, _STAGING_TIER).result()  # dirty: the eviction writes it home


def _copy_chunks(t: torch.Tensor, chunks: Chunks) -> None:
    dst = t.reshape(-1).view(torch.uint8)
    with contextlib.closing(chunks):
        for buf, off, n in chunks:
            dst[off : off + n].copy_(buf[:n])


def _replace_file(tm: Any, part: Any, claim: Any, directory: Path, pipe: ChunkPipeline, fill: Fill) -> None:
    """A new file of exactly the bytes in the home's `directory`, its digest computed as it is
    written, then committed: the backend adopts it ([Note: direct home I/O]); on any failure the
    old object stays and the claim is released."""
    tmp = temp_path(directory, part.name)
    committed = False
    try:
        fd, direct = open_direct(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:

            def drain(buf: torch.Tensor, off: int, n: int) -> None:
                pwrite_all(fd, buf, off, n, direct=direct)

            h = StreamingDigest(part.nbytes)
            with contextlib.closing(pipe.chunks(part.nbytes, fill, drain)) as chunks:
                for buf, _, n in chunks:
                    h.update(buf[:n])
            if os.fstat(fd).st_size != part.nbytes:
                os.ftruncate(fd, part.nbytes)  # the O_DIRECT padding of the last block
        finally:
            os.close(fd)
        committed = True  # commit_home releases the claim, whether the adoption works or not
        tm.commit_home(claim, tmp, h.intdigest())  # durable where the backend is: adopt_file
    finally:
        if not committed:
            tm.release_home(claim)
        remove_quietly(tmp)


def write_partition(tm: Any, part: Any, src: torch.Tensor) -> None:
    """Replace every byte of `part` with host tensor `src` (same dtype and numel)."""
    if src.dtype != part.dtype or src.numel() != part.numel:
        raise ValueError(
            f"partition {part.name!r}: checkpoint data has {src.numel()} elements of {src.dtype}, "
            f"expected {part.numel} of {part.dtype}"
        )
    if _memory_like(tm, part.home):
        t = tm.fetch(part, part.home).result()
        try:
            t.copy_(src.reshape(-1))
            tm.mark_dirty(part, part.home)  # other copies (a gathered one) are stale now
        finally:
            tm.release(part, part.home)
        return
    t = tm.allocate(part, _STAGING_TIER).result()
    try:
        t.copy_(src.reshape(-1))
    finally:
        tm.release(part, _STAGING_TIER)
    tm.evict(part, _STAGING_TIER).result()  # dirty: the eviction writes it home
