"""Bounded, double-buffered chunk copies between files, for checkpoints.

[Note: checkpoint chunk pipeline]
A partition whose newest bytes are only in a file (an NVMe swap file) is copied into a
checkpoint file, and back, through a few fixed buffers of ``chunk_bytes`` (``depth`` of them,
16 MiB x 3 by default) instead of one buffer the size of the partition: a 40B model's partition
is GBs, the buffers stay 48 MiB whatever the model. One reader thread fills the next chunks
while the caller's thread hashes and writes the current one, so the read of chunk k+1 overlaps
the write of chunk k; the caller is done with a chunk when it asks for the next, which is when
that buffer is handed back to the reader. Swap files are read and written with O_DIRECT where the
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
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tiered.device import PAGE_SIZE, default_device

ALIGN = 4096
DEFAULT_DEPTH = 3
_O_DIRECT = getattr(os, "O_DIRECT", 0)

Fill = Callable[[torch.Tensor, int, int], None]
"""fill(buf, offset, length): put bytes [offset, offset + length) of the source into buf[:length]
(buf is a page-aligned chunk buffer, possibly longer than length)."""


def align_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def open_direct(path: str, flags: int, mode: int = 0o600) -> tuple[int, bool]:
    """(fd, O_DIRECT in effect): O_DIRECT where the filesystem takes it (tmpfs does not)."""
    if _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, mode), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


def _drop_direct(fd: int) -> None:
    """Some filesystems take O_DIRECT at open and refuse it per call: go buffered for this fd."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def pread_exact(fd: int, buf: torch.Tensor, offset: int, length: int, *, direct: bool, what: str) -> None:
    """Fill buf[:length] from file offset `offset`; with O_DIRECT the read asks for the padded
    length and the end of the file cuts it short, as the nvme backend's reads do."""
    want = align_up(length) if direct else length
    mv = buf[:want].numpy().data.cast("B")
    done = 0
    while done < length:
        try:
            n = os.preadv(fd, [mv[done:want]], offset + done)
        except OSError as e:
            if not (direct and e.errno == errno.EINVAL):
                raise
            _drop_direct(fd)
            direct, want = False, length
            mv = buf[:want].numpy().data.cast("B")
            continue
        if n == 0:
            raise OSError(errno.EIO, f"{what}: file ended after {offset + done} bytes, {length - done} short")
        done += n


def pwrite_all(fd: int, buf: torch.Tensor, offset: int, length: int, *, direct: bool) -> bool:
    """Write buf[:length] at `offset` (padded to a block with O_DIRECT, so only for the end of a
    file the caller truncates afterwards); whether O_DIRECT is still in effect."""
    want = length
    if direct and length % ALIGN:
        want = align_up(length)
        buf[length:want].zero_()
    mv = buf[:want].numpy().data.cast("B")
    done = 0
    while done < want:
        try:
            done += os.pwritev(fd, [mv[done:]], offset + done)
        except OSError as e:
            if not (direct and e.errno == errno.EINVAL):
                raise
            _drop_direct(fd)
            direct, want = False, length
            mv = buf[:want].numpy().data.cast("B")
    return direct


class ChunkPipeline:
    """`depth` page-aligned buffers of `chunk_bytes` and one reader thread; see
    [Note: checkpoint chunk pipeline]. Reused for every partition of one save or load."""

    def __init__(self, chunk_bytes: int, depth: int = DEFAULT_DEPTH) -> None:
        if chunk_bytes <= 0 or depth < 2:
            raise ValueError(
                f"ChunkPipeline: chunk_bytes > 0 and depth >= 2 needed, got {chunk_bytes}, {depth}"
            )
        self.chunk_bytes = align_up(chunk_bytes, max(ALIGN, PAGE_SIZE))
        self.depth = depth
        self._bufs: list[torch.Tensor] = []
        self._reader: ThreadPoolExecutor | None = None

    def _start(self) -> None:
        if self._reader is None:
            # pinned where CUDA is present: a chunk bound for a GPU copy goes at full link speed
            self._bufs = [default_device().alloc_host(self.chunk_bytes) for _ in range(self.depth)]
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="tiered-checkpoint-read")

    def chunks(self, total: int, fill: Fill) -> Generator[tuple[torch.Tensor, int, int], None, None]:
        """Bytes [0, total) of a source, in order, as (buffer, offset, length): buffer[:length]
        holds bytes [offset, offset + length), until the next chunk is asked for (the whole
        buffer is the caller's meanwhile: `pwrite_all` pads the last block in it)."""
        self._start()
        assert self._reader is not None
        spans = [(o, min(self.chunk_bytes, total - o)) for o in range(0, total, self.chunk_bytes)]
        pending: deque[tuple[Future[None], torch.Tensor, int, int]] = deque()
        nxt = 0

        def submit() -> None:
            nonlocal nxt
            assert self._reader is not None
            buf = self._bufs[nxt % self.depth]
            off, n = spans[nxt]
            pending.append((self._reader.submit(fill, buf, off, n), buf, off, n))
            nxt += 1

        try:
            while nxt < len(spans) and len(pending) < self.depth - 1:
                submit()
            while pending:
                fut, buf, off, n = pending.popleft()
                fut.result()
                if nxt < len(spans):
                    submit()  # into the buffer the caller handed back by asking for this chunk
                yield buf, off, n
        finally:
            for fut, *_ in pending:  # an abandoned copy: no fill may still write a buffer
                with contextlib.suppress(BaseException):
                    fut.result()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        self._bufs = []

    def __enter__(self) -> ChunkPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
