"""Small swap objects packed into one slab file, and the requests issued together merged into few syscalls.

[Note: nvme swap index]
A swap backend's directory is private and deleted by ``close()``
([Note: nvme swap directories]): no other process and no later run reads it. So the backend keeps what it knows
of each key in memory, a `SwapEntry`: its size, where its payload starts in its file
([Note: nvme shifted swap files]) or its slot in the slab. A read needs no ``fstat`` (the size
is known), a write no ``ftruncate`` unless the object shrank by over a quarter (and 1 MiB): a
file keeps the blocks of a slightly larger earlier version (the same partition written from a
buffer with another shift needs one block more or less), as a shrink and a regrow would each
cost the filesystem an allocation. The file layout is the backend's to choose.

[Note: nvme slab coalescing]
A layer has dozens of partitions of 64 KiB - 1 MiB (norms, biases, small projections). One file
each costs an ``open``, a ``close`` and a thread handoff per partition, and one small I/O per
partition at the device: a layer's worth moved at a fifth of the large-transfer rate. In swap
mode, objects of at most ``coalesce_bytes`` live instead in slots of one slab file, opened once.
A slot is the object's size rounded up to `ALIGN`; a rewrite of the same rounded size reuses its
slot in place (as swap files are rewritten in place), freed slots are reused by size.

Requests for slab objects issued in the same event-loop tick (the tier manager issues a layer's
moves together) are queued, then sorted by offset, and runs of adjacent slots with the same
direction become one vectored ``pwritev`` / ``preadv`` of up to ``chunk_bytes`` and `IOV_MAX`
iovecs, straight from and into the callers' tensors (page-aligned ones; an unaligned tensor, or
the ragged tail of one, is staged through a small bounce block). Objects first written together
get adjacent slots, so a layer written together is read back as a few large requests.

Cancellation keeps the bridge's promise: a request cancelled before its run started is dropped;
one whose run is in flight waits for it, so no syscall touches the caller's tensor after the
cancelled call returned. A run's requests are settled when its task ends, however it ends: a task
cancelled before its first step (closing a manager cancels every task at once) never ran its
body, so without that its callers would wait for a syscall that was never issued.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tiered.units import align_down, align_up
from tiered_nvme.pieces import _IOV_MAX, ALIGN, FileEndedEarly

IOV_LIMIT = min(_IOV_MAX, 1024)


@dataclass(frozen=True)
class Slot:
    offset: int
    capacity: int


@dataclass
class SwapEntry:
    """What a swap backend knows of one key ([Note: nvme swap index])."""

    nbytes: int
    shift: int = 0
    """Where the payload starts in the key's own file ([Note: nvme shifted swap files])."""
    file_bytes: int = 0
    """The length of the key's own file (payload and block padding)."""
    slot: Slot | None = None
    """Its place in the slab instead of a file of its own ([Note: nvme slab coalescing])."""


class SlabSlots:
    """Slots of the slab file: a bump pointer and free lists by capacity. Loop thread only."""

    def __init__(self) -> None:
        self.end = 0
        self._free: dict[int, list[int]] = {}

    def take(self, nbytes: int) -> Slot:
        cap = align_up(max(nbytes, 1), ALIGN)
        free = self._free.get(cap)
        if free:
            return Slot(free.pop(), cap)
        slot = Slot(self.end, cap)
        self.end += cap
        return slot

    def give(self, slot: Slot) -> None:
        self._free.setdefault(slot.capacity, []).append(slot.offset)

    def free_bytes(self) -> int:
        return sum(cap * len(offs) for cap, offs in self._free.items())


@dataclass
class _Request:
    write: bool
    slot: Slot
    buf: torch.Tensor  # flat uint8, CPU
    future: asyncio.Future[None]
    started: bool = False
    dropped: bool = False


@dataclass
class _Run:
    """Adjacent requests of one direction: one syscall."""

    write: bool
    offset: int
    requests: list[_Request] = field(default_factory=list)
    nbytes: int = 0


class Coalescer:
    """Queues slab requests of one loop tick and runs them as merged vectored syscalls.

    `submit_run(fn, *args)` starts one blocking call (the backend's bridge and limiter) and
    returns an awaitable of its result; `fd()` is the slab's descriptor; `direct` says whether
    memory must be aligned (O_DIRECT)."""

    def __init__(
        self,
        submit_run: Callable[..., Any],
        fd: Callable[[], int],
        *,
        direct: bool,
        chunk_bytes: int,
        workers: int = 1,
    ) -> None:
        self._submit = submit_run
        self._fd = fd
        self.direct = direct
        self.chunk_bytes = chunk_bytes
        self.workers = workers
        self._pending: list[_Request] = []
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references
        self.syscalls = 0
        """Merged syscalls issued so far (for tests and stats)."""

    async def submit(self, write: bool, slot: Slot, buf: torch.Tensor) -> None:
        loop = asyncio.get_running_loop()
        req = _Request(write, slot, buf, loop.create_future())
        self._pending.append(req)
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        try:
            await asyncio.shield(req.future)
        except asyncio.CancelledError:
            if not req.started:
                req.dropped = True
                raise
            while not req.future.done():  # its syscall may be touching `buf`: wait it out
                try:
                    await asyncio.shield(req.future)
                except asyncio.CancelledError:
                    continue
                except BaseException:  # noqa: BLE001 - we are cancelled; its outcome is moot
                    break
            raise

    def _flush(self) -> None:
        self._scheduled = False
        reqs = [r for r in self._pending if not r.dropped]
        self._pending = []
        for run in self.merge(reqs):
            for r in run.requests:
                r.started = True
            task = asyncio.ensure_future(self._do(run))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(functools.partial(_settle, run))

    def merge(self, reqs: list[_Request]) -> list[_Run]:
        """Runs of adjacent slots, one direction each, within `chunk_bytes` and the iovec limit,
        and no larger than a fair share of the batch, so every worker gets a run."""
        total, w = sum(r.slot.capacity for r in reqs), max(1, self.workers)
        share = -(-total // (w * -(-total // (w * self.chunk_bytes)))) if total else 0  # whole waves
        runs: list[_Run] = []
        cur: _Run | None = None
        for r in sorted(reqs, key=lambda r: (r.write, r.slot.offset)):
            if (
                cur is None
                or cur.write != r.write
                or cur.offset + cur.nbytes != r.slot.offset
                or cur.nbytes >= share
                or cur.nbytes + r.slot.capacity > self.chunk_bytes
                or 2 * (len(cur.requests) + 1) > IOV_LIMIT
            ):
                cur = _Run(r.write, r.slot.offset)
                runs.append(cur)
            cur.requests.append(r)
            cur.nbytes += r.slot.capacity
        return runs

    async def _do(self, run: _Run) -> None:
        try:
            await self._submit(self._blocking_run, run)
        except BaseException as exc:
            for r in run.requests:
                if not r.future.done():
                    r.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for r in run.requests:
            if not r.future.done():
                r.future.set_result(None)

    # ---- blocking (a bridge thread) ----------------------------------------------------------
    def _blocking_run(self, run: _Run) -> None:
        iovs: list[memoryview] = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (caller's bytes, bounce bytes)
        keep: list[torch.Tensor] = []
        for r in run.requests:
            n, cap = r.buf.numel(), r.slot.capacity
            aligned = not self.direct or r.buf.data_ptr() % ALIGN == 0
            body = (align_down(n, ALIGN) if self.direct else n) if aligned else 0
            if body:
                iovs.append(r.buf[:body].numpy().data)
            if cap > body:
                block = _aligned_block(cap - body)
                keep.append(block)
                if run.write:
                    block[: n - body].copy_(r.buf[body:n])
                    block[n - body :].zero_()
                else:
                    staged.append((r.buf[body:n], block[: n - body]))
                iovs.append(block.numpy().data)
        fd = self._fd()
        self.syscalls += 1
        if run.write:
            _writev_all(fd, iovs, run.offset)
        else:
            got = _readv_all(fd, iovs, run.offset)
            if got < run.nbytes:
                raise FileEndedEarly(
                    f"slab file ended early: got {got} of {run.nbytes} bytes at {run.offset}"
                )
            for dst, src in staged:
                dst.copy_(src)


def _aligned_block(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off : off + nbytes]


def _advance(iovs: list[memoryview], done: int) -> list[memoryview]:
    out = []
    for mv in iovs:
        if done >= len(mv):
            done -= len(mv)
            continue
        out.append(mv[done:])
        done = 0
    return out


def _writev_all(fd: int, iovs: list[memoryview], offset: int) -> None:
    total = sum(len(m) for m in iovs)
    done = 0
    while done < total:
        n = os.pwritev(fd, _advance(iovs, done), offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwritev wrote {n} bytes at offset {offset + done}")
        done += n


def _readv_all(fd: int, iovs: list[memoryview], offset: int) -> int:
    total = sum(len(m) for m in iovs)
    done = 0
    while done < total:
        n = os.preadv(fd, _advance(iovs, done), offset + done)
        if n == 0:
            break
        done += n
    return done


def _settle(run: _Run, task: asyncio.Task[None]) -> None:
    """`run`'s task ended: fail the requests it left unresolved. Its syscall, if any, has returned
    (the bridge waits for it), so their callers may let go of their tensors."""
    exc = None if task.cancelled() else task.exception()
    for r in run.requests:
        if not r.future.done():
            r.future.set_exception(exc or asyncio.CancelledError())
