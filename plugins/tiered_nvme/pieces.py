"""How one object's bytes are cut into O_DIRECT syscalls: the plan, and the blocking piece I/O.

[Note: nvme shifted swap files]
O_DIRECT needs the memory address, the file offset and the length of every transfer aligned to
the device's block (`ALIGN`). A caller buffer `shift` bytes past a block (``torch.empty`` gives
64 B past a page) can never meet that with its payload at file offset 0: byte i sits at address
``P + i`` and file offset ``i``, which are never both aligned. So every byte went through a
bounce buffer: a memcpy of the whole object on each write and read (25-55% of the bandwidth).

A swap file is private to its backend, which knows each key's size without the file's length
([Note: nvme swap index]), so it may lay the payload out as it likes. It stores a write from a
buffer ``shift = P % ALIGN`` past a block at file offset `shift`: then byte i sits at address
``P + i`` and file offset ``shift + i``, both ``shift`` past a block. Everything between the
first and the last block boundary moves straight from or to the caller's memory; only the head
block (the `shift` bytes before the payload are zeros) and the tail block go through the bounce
buffer, at most 2 x 4 KiB per object. A read into a buffer with the same shift (the same
allocator hands out the same shift) is as direct; one with another shift falls back to bouncing
every chunk, as every read of an unaligned buffer did before. Files of persistent and scratch
tiers keep shift 0: they are plain payload dumps ([Note: nvme on-disk size]).

A plan is a list of `Piece`: an aligned span of the file and whether it moves straight between
the caller's memory and the file (``direct``) or through a bounce buffer. The payload is the
file range ``[shift, shift + n)``; a bounce piece carries the part of it that its span covers.
"""

from __future__ import annotations

import errno
import os
from typing import NamedTuple

import torch

from tiered.units import align_down, align_up

TRUNCATED_REMEDY = (
    "the file is shorter than what was written (truncated by another process, or a disk that filled "
    "up): those bytes are lost and were not used; restore the training state from a checkpoint "
    "(engine.load_checkpoint, tiered finetune --resume)"
)


class FileEndedEarly(OSError):
    """A read found fewer bytes than were stored: the file was truncated behind the backend's
    back. Corruption, not a transient error: it carries no errno, so it is never retried
    ([Note: retries of transient errors] in tiered.tiers.io_policy)."""


ALIGN = 4096
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class Piece(NamedTuple):
    """One syscall's worth: file bytes ``[offset, offset + span)``."""

    offset: int
    span: int
    bounce: bool


def plan(n: int, shift: int, mem_shift: int, *, direct: bool, chunk: int) -> list[Piece]:
    """The pieces that move payload ``[shift, shift + n)`` of a file to or from a buffer whose
    address is `mem_shift` bytes past a block ([Note: nvme shifted swap files]).

    Without O_DIRECT nothing needs aligning: plain pieces of the payload itself (``shift`` is 0)."""
    if n == 0:
        return []
    if not direct:
        return [Piece(shift + o, min(chunk, n - o), False) for o in range(0, n, chunk)]
    end = shift + n
    lo, hi = align_up(shift, ALIGN), align_down(end, ALIGN)
    if mem_shift % ALIGN != shift % ALIGN or lo >= hi:  # no byte lines up: bounce everything
        start, stop = align_down(shift, ALIGN), align_up(end, ALIGN)
        return [Piece(o, min(chunk, stop - o), True) for o in range(start, stop, chunk)]
    pieces = [Piece(align_down(shift, ALIGN), ALIGN, True)] if shift % ALIGN else []
    pieces += [Piece(o, min(chunk, hi - o), False) for o in range(lo, hi, chunk)]
    if end > hi:
        pieces.append(Piece(hi, align_up(end, ALIGN) - hi, True))
    return pieces


def segments(mv: memoryview, block: int) -> list[memoryview]:
    """`mv` as iovecs of `block` bytes (fewer, larger ones if IOV_MAX demands)."""
    seg = max(block, -(-len(mv) // _IOV_MAX))
    return [mv[i : i + seg] for i in range(0, len(mv), seg)]


def pwrite_all(fd: int, mv: memoryview, offset: int, block: int) -> None:
    done = 0
    while done < len(mv):
        n = os.pwritev(fd, segments(mv[done:], block), offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwritev wrote {n} bytes at offset {offset + done}")
        done += n


def pread_all(fd: int, mv: memoryview, offset: int, block: int) -> int:
    done = 0
    while done < len(mv):
        n = os.preadv(fd, segments(mv[done:], block), offset + done)
        if n == 0:
            break  # end of file: the padded tail of [Note: nvme on-disk size]
        done += n
    return done


def payload_window(piece: Piece, shift: int, n: int) -> tuple[int, int]:
    """The payload bytes ``[lo, hi)`` (payload coordinates) that `piece` covers."""
    lo = max(piece.offset, shift) - shift
    hi = min(piece.offset + piece.span, shift + n) - shift
    return lo, hi


def write_piece(
    fd: int, src: torch.Tensor, piece: Piece, shift: int, block: int, bounce: torch.Tensor | None
) -> None:
    """Write `piece` of payload `src` (flat uint8, stored at file offset `shift`)."""
    lo, hi = payload_window(piece, shift, src.numel())
    if not piece.bounce:
        pwrite_all(fd, src[lo:hi].numpy().data, piece.offset, block)
        return
    assert bounce is not None
    at = shift + lo - piece.offset  # where the payload starts inside the span
    bounce[:at].zero_()
    bounce[at : at + hi - lo].copy_(src[lo:hi])
    bounce[at + hi - lo : piece.span].zero_()
    pwrite_all(fd, bounce[: piece.span].numpy().data, piece.offset, block)


def read_piece(
    fd: int, dst: torch.Tensor, piece: Piece, shift: int, block: int, bounce: torch.Tensor | None
) -> None:
    """Read `piece` into payload `dst`; FileEndedEarly if the file ends before the payload does."""
    lo, hi = payload_window(piece, shift, dst.numel())
    if not piece.bounce:
        got = pread_all(fd, dst[lo:hi].numpy().data, piece.offset, block)
        need = hi - lo
    else:
        assert bounce is not None
        at = shift + lo - piece.offset
        got = pread_all(fd, bounce[: piece.span].numpy().data, piece.offset, block)
        need = at + hi - lo
        dst[lo : lo + max(0, min(got, need) - at)].copy_(bounce[at : max(at, min(got, need))])
    if got < need:
        raise FileEndedEarly(f"file ended early: got {got} of {need} bytes at offset {piece.offset}")


def finish_in_place(fd: int, nbytes: int, fsync: bool) -> None:
    if os.fstat(fd).st_size != nbytes:
        os.ftruncate(fd, nbytes)  # a shorter overwrite, or the O_DIRECT padding: the true size
    if fsync:
        os.fsync(fd)


def finish_swap_file(fd: int, nbytes: int | None, fsync: bool) -> None:
    if nbytes is not None:
        os.ftruncate(fd, nbytes)  # the object shrank: give the disk back
    if fsync:
        os.fsync(fd)


def finish_file(fd: int, nbytes: int, direct: bool, fsync: bool) -> None:
    if direct and nbytes % ALIGN:
        os.ftruncate(fd, nbytes)  # drop the padding: [Note: nvme on-disk size]
    if fsync:
        os.fsync(fd)
