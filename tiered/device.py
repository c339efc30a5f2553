"""The compute device, owned by one object: allocation, side-stream copies, events, sync.

[Note: one device object]
Every CUDA-specific line of the storage layer (and later of the engine) sits behind `Device`:
page-locked host buffers, the side copy stream, events and `synchronize`. On a CPU-only host the
same calls are plain host operations: copies run synchronously, events are always complete and
"device memory" is host memory. Callers therefore never branch on ``torch.cuda.is_available()``
themselves, and the CPU path (the one CI runs) exercises the same call sequence as the GPU path.

[Note: page-aligned host buffers]
O_DIRECT file I/O needs the buffer address, file offset and length aligned to the logical block
size (512 B or 4 KiB). torch's CPU allocator only guarantees 64-byte alignment, so `alloc_host`
over-allocates by one page and returns the page-aligned slice; the slice keeps the whole storage
alive. With CUDA the buffer is page-locked (``pin_memory=True``) so host<->device copies run
asynchronously at full link speed; the same slicing keeps it page aligned.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import mmap
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from tiered.errors import TierTimeoutError

log = logging.getLogger(__name__)

PAGE_SIZE: int = mmap.PAGESIZE


def is_aligned(t: torch.Tensor, align: int = PAGE_SIZE) -> bool:
    """True when `t`'s first byte sits on an `align` boundary."""
    return t.data_ptr() % align == 0


@dataclass
class CopyEvent:
    """Completion handle of a copy: a CUDA event, or nothing (already complete) on the CPU."""

    cuda_event: Any = None

    def query(self) -> bool:
        return self.cuda_event is None or bool(self.cuda_event.query())

    def synchronize(self) -> None:
        if self.cuda_event is not None:
            self.cuda_event.synchronize()


class Device:
    """The compute device: CUDA when available (or when asked), otherwise the CPU.

    See [Note: one device object].
    """

    def __init__(self, kind: str | None = None, index: int = 0) -> None:
        if kind is None:
            kind = "cuda" if torch.cuda.is_available() else "cpu"
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"Device kind must be 'cuda' or 'cpu', got {kind!r}")
        if kind == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("Device('cuda') requested but torch sees no CUDA device; use Device('cpu')")
        self.kind = kind
        self.torch_device = torch.device(kind, index) if kind == "cuda" else torch.device("cpu")
        self._copy_stream: Any = None

    # ---- properties ------------------------------------------------------------------------
    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def name(self) -> str:
        return str(self.torch_device)

    @property
    def copy_stream(self) -> Any:
        """The side stream host<->device copies run on (None on the CPU)."""
        if self.is_cuda and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.torch_device)
        return self._copy_stream

    # ---- allocation ------------------------------------------------------------------------
    def alloc_host(self, nbytes: int, pin: bool = True) -> torch.Tensor:
        """A flat uint8 host tensor of `nbytes`, page aligned; page-locked when CUDA is present.

        See [Note: page-aligned host buffers]. Contents are undefined.
        """
        if nbytes < 0:
            raise ValueError(f"alloc_host: nbytes must be >= 0, got {nbytes}")
        pin = pin and self.is_cuda
        raw = torch.empty(nbytes + PAGE_SIZE, dtype=torch.uint8, pin_memory=pin)
        offset = (-raw.data_ptr()) % PAGE_SIZE
        return raw[offset : offset + nbytes]

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor of `nbytes` in device memory (host memory on the CPU)."""
        if self.is_cuda:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)
        return self.alloc_host(nbytes, pin=False)

    def mem_info(self) -> tuple[int | None, int | None]:
        """(free_bytes, total_bytes) of device memory; host RAM on the CPU."""
        if self.is_cuda:
            free, total = torch.cuda.mem_get_info(self.torch_device)
            return int(free), int(total)
        return host_mem_info()

    # ---- copies and events -----------------------------------------------------------------
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        """Start ``dst.copy_(src)``; on CUDA it runs on the side stream and returns its event.

        The caller must keep both tensors alive until the event completes. On the CPU the copy
        is done when this returns.
        """
        if not self.is_cuda or (dst.device.type == "cpu" and src.device.type == "cpu"):
            dst.copy_(src)
            return CopyEvent()
        stream = self.copy_stream
        # The side stream must see everything the compute stream queued on these tensors.
        stream.wait_stream(torch.cuda.current_stream(self.torch_device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        for t in (dst, src):
            if t.device.type == "cuda":
                t.record_stream(stream)
        return CopyEvent(event)

    def record_event(self) -> CopyEvent:
        """An event marking the current point of the compute stream (complete on the CPU)."""
        if not self.is_cuda:
            return CopyEvent()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.torch_device))
        return CopyEvent(event)

    async def wait(self, event: CopyEvent, *, timeout_s: float = 600.0, what: str = "copy") -> None:
        """Await `event` without blocking the event loop; TierTimeoutError after `timeout_s`."""
        if event.query():
            return
        deadline = time.monotonic() + timeout_s
        delay = 5e-5
        while not event.query():
            if time.monotonic() > deadline:
                raise TierTimeoutError(
                    f"{what}: device copy did not complete within {timeout_s:.0f} s on {self.name}; "
                    "the GPU may be hung or oversubscribed"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2e-3)

    def synchronize(self) -> None:
        """Wait for all queued device work (no-op on the CPU)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)

    def __repr__(self) -> str:
        return f"Device({self.name!r})"


@functools.cache
def default_device() -> Device:
    """The process-wide compute device (created on first use)."""
    device = Device()
    log.debug("compute device: %s", device.name)
    return device


def host_mem_info() -> tuple[int | None, int | None]:
    """(available_bytes, total_bytes) of host memory: what the kernel could give this process now
    without swapping (``MemAvailable``: free pages and the page cache it can drop, not ``MemFree``,
    which a machine that has read files for a while keeps near zero), within the cgroup's limit
    where one is set (a container's ``memory.max``). None where the system cannot tell."""
    total = avail = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        total = int(fields["MemTotal"].split()[0]) * 1024
        avail = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            avail, total = os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
        except (ValueError, OSError, AttributeError):  # not every OS has these sysconf names
            return None, None
    limit = _cgroup_memory_limit()
    if limit is not None:
        cap, used = limit
        total = min(total, cap) if total is not None else cap
        avail = min(avail, max(0, cap - used)) if avail is not None else max(0, cap - used)
    return avail, total


def _cgroup_memory_limit() -> tuple[int, int] | None:
    """(limit, usage) of this process's memory cgroup (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), or None without a limit."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            lines = [x.strip().split(":", 2) for x in f if x.count(":") >= 2]
    except OSError:
        return None
    for _, controllers, path in lines:
        if controllers == "":
            files = ("/sys/fs/cgroup", "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            files = ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        base = os.path.join(files[0], path.lstrip("/"))
        try:
            with open(os.path.join(base, files[1]), encoding="ascii") as f:
                cap = f.read().strip()
            if cap == "max" or int(cap) >= 1 << 60:  # v1 writes "no limit" as a huge number
                continue
            with open(os.path.join(base, files[2]), encoding="ascii") as f:
                return int(cap), int(f.read().strip())
        except (OSError, ValueError):
            continue
    return None
