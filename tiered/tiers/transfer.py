"""`Transfers`: the bytes of one move on one link - bounded per link, timed, traced, checked.

A transfer writes no partition or budget state: the `TierStateMachine` decides what moves where
and records the outcome; this object only copies bytes (through the backends, the loop's I/O
bridge, or the device's side stream) and keeps the per-link counters and the trace.

Every byte between tiers passes through `run` (one move on one link) and every backend call
through `io` (bounded by the manager's timeout); every read back from a tier through `read_into`.
So a checksum check on every read from a non-memory tier belongs in `read_into`, timeouts scaled
by bytes and retries of transient errors in `io` / `run`; what a backend declares it can take
(alignment, concurrency) reaches the manager in `TierBudget.of` and, for concurrency, the link
bounds here and the bridge the manager hands its backends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import torch

from tiered.device import default_device
from tiered.tiers.budget import TierBudget
from tiered.tiers.checksum import check_crc, crc32_of
from tiered.tiers.error_context import raise_in_context, where
from tiered.tiers.loop import EventLoopThread
from tiered.tiers.partition import Partition
from tiered.tiers.stats import ManagerStats
from tiered.tiers.trace import TraceRecorder
from tiered.tiers.waiting import bounded

T = TypeVar("T")


class Transfers:
    """Moves bytes between the tiers' backends; see the module docstring."""

    def __init__(
        self,
        tiers: dict[str, TierBudget],
        loop: EventLoopThread,
        *,
        timeout_s: float,
        max_inflight_per_link: int,
        verify: bool,
        stats: ManagerStats,
        trace: TraceRecorder,
    ) -> None:
        self._tiers = tiers
        self.loop = loop
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight_per_link
        self.verify = verify
        self.stats = stats
        self.trace = trace
        self._sems: dict[str, asyncio.Semaphore] = {}

    def ctx(self, part: Partition, tier: str, op: str) -> str:
        return where(op, part.name, tier, self._tiers[tier].backend.name)

    async def io(self, aw: Awaitable[T], what: str) -> T:
        """A backend call, bounded by the manager's timeout."""
        return await bounded(
            aw, self.timeout_s, lambda: f"{what}: the backend did not answer within {self.timeout_s} s"
        )

    async def checksum(self, buf: torch.Tensor) -> int:
        return await self.loop.run_blocking(crc32_of, buf)

    def _link_sem(self, src: str, dst: str) -> asyncio.Semaphore:
        key = f"{src}->{dst}"
        sem = self._sems.get(key)
        if sem is None:
            sem = self._sems[key] = asyncio.Semaphore(self.max_inflight)
        return sem

    async def run(self, part: Partition, src: str, dst: str, op: str, fill: Callable[[], Awaitable[T]]) -> T:
        """Run `fill` as one move on link src->dst: bounded concurrency, stats, trace, context."""
        sem = self._link_sem(src, dst)
        await bounded(
            sem.acquire(),
            self.timeout_s,
            lambda: f"{op} of partition {part.name!r}: link {src}->{dst} stayed busy for {self.timeout_s} s",
        )
        link = self.stats.link(src, dst)
        link.begin()
        t0 = time.perf_counter()
        ok = False
        try:
            out = await fill()
            ok = True
            return out
        except BaseException as exc:  # noqa: BLE001 - re-raised with the move's context
            sb, db = self._tiers[src].backend, self._tiers[dst].backend
            raise_in_context(
                exc,
                (
                    f"{op} of partition {part.name!r}: move {src}->{dst} failed (key {part.name!r}; "
                    f"source backend {sb.name!r}, destination backend {db.name!r})"
                ),
            )
        finally:
            t1 = time.perf_counter()
            link.end(part.nbytes, ok)
            sem.release()
            if ok:
                self.stats.tiers[src].reads += 1
                self.stats.tiers[dst].writes += 1
                self.trace.add(part.name, f"{src}->{dst}", t0, t1, bytes=part.nbytes, op=op)

    async def mem_copy(self, dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
        """Copy between resident tensors: host copies on the bridge, device copies on the side
        stream of the one device object (see [Note: one device object] in tiered.device)."""
        if dst.device.type == "cpu" and src.device.type == "cpu":
            await self.loop.run_blocking(dst.copy_, src)
            return
        dev = default_device()
        event = dev.copy_async(dst, src)
        await dev.wait(event, timeout_s=self.timeout_s, what=what)

    async def read_into(self, part: Partition, src: str, dst: str, buf: torch.Tensor, op: str) -> None:
        """Fill resident `buf` (in memory-like `dst`) from `src`'s copy, verifying if asked."""
        sts = self._tiers[src]

        async def fill() -> None:
            if sts.memory_like:
                await self.mem_copy(buf, sts.backend.view(part.name), self.ctx(part, src, op))
                return
            await self.io(sts.backend.read(part.name, buf), self.ctx(part, src, op))
            want = part.checksum(src)
            if self.verify and sts.persistent and want is not None:
                check_crc(await self.checksum(buf), want, self.ctx(part, src, op), dst)

        await self.run(part, src, dst, op, fill)

    async def write_from(self, part: Partition, src: str, dst: str, op: str) -> int | None:
        """Write `src`'s resident copy into `dst`'s storage (a write-back to home); the crc32 of
        what was written when `dst` is persistent, for the caller to record."""
        dts = self._tiers[dst]
        srcbuf = self._tiers[src].backend.view(part.name)

        async def fill() -> int | None:
            if dts.memory_like:
                await self.mem_copy(dts.backend.view(part.name), srcbuf, self.ctx(part, dst, op))
                return None
            jobs: list[Awaitable[Any]] = [
                self.io(dts.backend.write(part.name, srcbuf), self.ctx(part, dst, op))
            ]
            if dts.persistent:
                jobs.append(self.checksum(srcbuf))
            res = await asyncio.gather(*jobs)
            return res[1] if dts.persistent else None

        return await self.run(part, src, dst, op, fill)
