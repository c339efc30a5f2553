"""Bounded, double-buffered chunk copies between files, for checkpoints.

[Note: checkpoint chunk pipeline]
A partition whose newest bytes are only in a file (an NVMe swap file) is copied into a
checkpoint file, and back, through a few fixed buffers of ``chunk_bytes`` (``depth`` of them,
16 MiB x 4 by default) instead of one buffer the size of the partition: a 40B model's partition
is GBs, the buffers stay 64 MiB whatever the model. A few I/O threads (3) fill the next chunks
while the caller's thread hashes the current one in order (a streaming digest must see the
bytes in order) and, for a save, writes it into the checkpoint file; for a load the writes of
finished chunks into the new swap file run on the I/O threads too, several at once, as the nvme
backend's own writes do (one synchronous O_DIRECT write at a time leaves most of a drive idle).
So reads of later chunks overlap the hashing and writing of earlier ones, and a buffer is filled
again only once its chunk has been written. Swap files are read and written with O_DIRECT where the
filesystem allows it, as the nvme backend does ([Note: nvme I/O path]): page-aligned buffers,
aligned offsets, the last block padded and the file truncated to its true size, so a checkpoint
of hundreds of GB does not push everything else out of the page cache (and is read from the
device, not from a cached copy). The checksums (the checkpoint file's, and the xxh3 of each
partition that the tier recorded, [Note: partition checksums]) are computed over the same chunks
as they pass, so no byte is read twice for them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from tiered.device import PAGE_SIZE, default_device
from tiered.units import align_up

ALIGN = 4096
DEFAULT_DEPTH = 4
DEFAULT_THREADS = 3
_O_DIRECT = getattr(os, "O_DIRECT", 0)

Fill = Callable[[torch.Tensor, int, int], None]
"""fill(buf, offset, length): put bytes [offset, offset + length) of the source into buf[:length]
(buf is a page-aligned chunk buffer, possibly longer than length)."""


def open_direct(path: str, flags: int, mode: int = 0o600) -> tuple[int, bool]:
    """(fd, O_DIRECT in effect): O_DIRECT where the filesystem takes it (tmpfs does not)."""
    if _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, mode), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


def _all_bytes(
    fd: int, buf: torch.Tensor, offset: int, length: int, want: int, *, direct: bool, write: bool, what: str
) -> bool:
    """Move buf[:want] to or from file offset `offset` until `length` bytes are read, or all `want`
    (the padded length, with O_DIRECT) are written; whether O_DIRECT is still in effect.

    Some filesystems take O_DIRECT at open and refuse it per call (EINVAL): then this fd goes
    buffered, the rest unpadded, and the call is retried. The one place that fallback is written,
    for reads and writes alike."""
    call = os.pwritev if write else os.preadv
    mv = buf[:want].numpy().data.cast("B")
    done = 0
    while done < (want if write else length):
        try:
            n = call(fd, [mv[done:want]], offset + done)
        except OSError as e:
            if not (direct and e.errno == errno.EINVAL):
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
            direct, want = False, length
            mv = buf[:want].numpy().data.cast("B")
            continue
        if n == 0:
            verb = "took no more bytes" if write else "ended"
            raise OSError(
                errno.EIO, f"{what}: file {verb} after {offset + done} bytes, {length - done} short"
            )
        done += n
    return direct


def pread_exact(fd: int, buf: torch.Tensor, offset: int, length: int, *, direct: bool, what: str) -> None:
    """Fill buf[:length] from file offset `offset`; with O_DIRECT the read asks for the padded
    length and the end of the file cuts it short, as the nvme backend's reads do."""
    want = align_up(length, ALIGN) if direct else length
    _all_bytes(fd, buf, offset, length, want, direct=direct, write=False, what=what)


def pwrite_all(fd: int, buf: torch.Tensor, offset: int, length: int, *, direct: bool) -> bool:
    """Write buf[:length] at `offset` (padded to a block with O_DIRECT, so only for the end of a
    file the caller truncates afterwards); whether O_DIRECT is still in effect."""
    want = length
    if direct and length % ALIGN:
        want = align_up(length, ALIGN)
        buf[length:want].zero_()
    return _all_bytes(fd, buf, offset, length, want, direct=direct, write=True, what="checkpoint write")


class ChunkPipeline:
    """`depth` page-aligned buffers of `chunk_bytes` and `threads` I/O threads; see
    [Note: checkpoint chunk pipeline]. Reused for every partition of one save or load."""

    def __init__(self, chunk_bytes: int, depth: int = DEFAULT_DEPTH, threads: int = DEFAULT_THREADS) -> None:
        if chunk_bytes <= 0 or depth < 2 or threads < 1:
            raise ValueError(
                "ChunkPipeline: chunk_bytes > 0, depth >= 2 and threads >= 1 needed, got "
                f"{chunk_bytes}, {depth}, {threads}"
            )
        self.chunk_bytes = align_up(chunk_bytes, max(ALIGN, PAGE_SIZE))
        self.depth = depth
        self.threads = threads
        self._bufs: list[torch.Tensor] = []
        self._pool: ThreadPoolExecutor | None = None

    def _start(self) -> ThreadPoolExecutor:
        if self._pool is None:
            # pinned where CUDA is present: a chunk bound for a GPU copy goes at full link speed
            self._bufs = [default_device().alloc_host(self.chunk_bytes) for _ in range(self.depth)]
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tiered-checkpoint-io")
        return self._pool

    def chunks(
        self, total: int, fill: Fill, drain: Fill | None = None
    ) -> Generator[tuple[torch.Tensor, int, int], None, None]:
        """Bytes [0, total) of a source, in order, as (buffer, offset, length): buffer[:length]
        holds bytes [offset, offset + length), and the whole buffer is the caller's (`pwrite_all`
        pads the last block in it) until it asks for the next chunk. Then `drain(buffer, offset,
        length)`, if given, runs on an I/O thread (several at once, in any order) before the
        buffer is filled again; every drain has ended when the generator finishes."""
        pool = self._start()
        spans = [(o, min(self.chunk_bytes, total - o)) for o in range(0, total, self.chunk_bytes)]
        free = deque(range(self.depth))  # buffers with no fill or drain in flight
        fills: deque[tuple[Future[None], int, int, int]] = deque()  # in chunk order
        drains: dict[int, Future[None]] = {}
        nxt = 0
        try:
            while nxt < len(spans) or fills:
                for b in [b for b, f in drains.items() if f.done()]:
                    drains.pop(b).result()  # a failed drain fails the copy
                    free.append(b)
                while free and nxt < len(spans):
                    b = free.popleft()
                    off, n = spans[nxt]
                    fills.append((pool.submit(fill, self._bufs[b], off, n), b, off, n))
                    nxt += 1
                if not fills:  # every buffer is draining: wait for one
                    wait(drains.values(), return_when=FIRST_COMPLETED)
                    continue
                fut, b, off, n = fills.popleft()
                fut.result()
                yield self._bufs[b], off, n
                if drain is not None:
                    drains[b] = pool.submit(drain, self._bufs[b], off, n)
                else:
                    free.append(b)
            for f in drains.values():
                f.result()
            drains.clear()
        finally:
            # an abandoned or failed copy: no fill or drain may still touch a buffer or a file
            for f in [*(f for f, *_ in fills), *drains.values()]:
                with contextlib.suppress(BaseException):
                    f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._bufs = []

    def __enter__(self) -> ChunkPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
