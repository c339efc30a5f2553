"""The conformance checks that a backend really has the capabilities it declares.

A mixin of `tiered.testing.BackendConformance` (which provides `run`, `_reopen` and the backend);
each check's rule is the capabilities table of docs/backends.md.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from tiered.storage.base import StorageBackend
from tiered.storage.bridge import CapacityLimiter, IOBridge
from tiered.testing.data import random_bytes

T = TypeVar("T")


def aligned_empty(nbytes: int, align: int) -> torch.Tensor:
    """A uint8 tensor whose first byte sits on an `align`-byte boundary."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    off = (-raw.data_ptr()) % align
    return raw[off : off + nbytes]


class CountingBridge(IOBridge):
    """An `IOBridge` that records the most calls running at once (`peak`)."""

    def __init__(self, max_concurrency: int, *, name: str = "counting") -> None:
        super().__init__(max_concurrency, name=name)
        self._count_lock = threading.Lock()
        self.running = 0
        self.peak = 0

    def submit(self, fn: Callable[..., T], *args: Any, limiter: CapacityLimiter | None = None) -> Any:
        def counted(*a: Any) -> T:
            with self._count_lock:
                self.running += 1
                self.peak = max(self.peak, self.running)
            try:
                return fn(*a)
            finally:
                with self._count_lock:
                    self.running -= 1

        return super().submit(counted, *args, limiter=limiter)


class CapabilityChecks:
    """Declared alignment, concurrency and persistence hold (see the module docstring)."""

    def run(self, tmp_path: Path, scenario: Callable[[StorageBackend], Awaitable[T]]) -> T:
        raise NotImplementedError  # BackendConformance's harness

    async def _reopen(self, b: StorageBackend, tmp_path: Path) -> StorageBackend:
        raise NotImplementedError  # BackendConformance's harness

    def test_declared_alignment_holds(self, tmp_path: Path) -> None:
        """`alignment_bytes` N: buffers on N (the fast path) round-trip, and so do buffers off it
        by any amount, written at one offset and read back at another (docs/backends.md)."""

        async def scenario(b: StorageBackend) -> None:
            align = b.capabilities.alignment_bytes
            n = (2 << 20) + 4097
            shifts = sorted({0, 1, 64, align // 2, align - 1} & set(range(max(align, 65))))
            pool = aligned_empty(n + 2 * max(align, 64), align)
            for i, w in enumerate(shifts):
                src = pool[w : w + n]
                assert (src.data_ptr() - w) % align == 0
                src.copy_(random_bytes(n, seed=90 + i))
                key = f"aligned-{w}"
                await b.write(key, src)
                for r in shifts:
                    out = aligned_empty(n + r, align)[r:]
                    await b.read(key, out)
                    assert torch.equal(out, src), (
                        f"written {w} B past an {align}-byte boundary, read {r} B past one: other bytes"
                    )

        self.run(tmp_path, scenario)

    def test_declared_concurrency_holds(self, tmp_path: Path) -> None:
        """`io_concurrency` N: never more than N of the backend's blocking calls run on its bridge
        at once; `max_concurrency` M: M requests at once are all served."""

        async def scenario(b: StorageBackend) -> None:
            declared = getattr(b, "io_concurrency", 0)
            caps = b.capabilities
            assert isinstance(caps.max_concurrency, int) and caps.max_concurrency >= 0, (
                f"max_concurrency must be an int >= 0, got {caps.max_concurrency!r}"
            )
            bridge = CountingBridge(declared + 8, name="conformance-counting")
            try:
                b.use_bridge(bridge)
                width = caps.max_concurrency or 32
                data = [random_bytes((1 << 20) + 7 * i, seed=120 + i) for i in range(width)]
                await asyncio.gather(*(b.write(f"conc{i}", d) for i, d in enumerate(data)))
                outs = [torch.empty_like(d) for d in data]
                await asyncio.gather(*(b.read(f"conc{i}", o) for i, o in enumerate(outs)))
                assert all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))
            finally:
                b.use_bridge(None)
                bridge.close()
            if declared:
                assert bridge.peak <= declared, (
                    f"io_concurrency {declared} declared, but {bridge.peak} blocking calls ran at once"
                )

        self.run(tmp_path, scenario)

    def test_declared_persistence_survives_close_and_reopen(self, tmp_path: Path) -> None:
        """`persistent`: what was written is read back by a new instance after this one closed."""

        async def scenario(b: StorageBackend) -> None:
            if not b.capabilities.persistent:
                return  # nothing is promised past the process (nor forbidden within it)
            data = random_bytes(70_000, seed=130)
            await b.write("survivor", data)
            await b.close()
            again = await self._reopen(b, tmp_path)
            try:
                out = torch.empty_like(data)
                await again.read("survivor", out)
                assert torch.equal(out, data), "persistent declared, but the bytes did not survive close"
            finally:
                await again.close()

        self.run(tmp_path, scenario)
