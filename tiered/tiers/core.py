"""The tier manager's state machine: budgets, moves, evictions, write-backs. Loop thread only.

[Note: reserve before move]
Budgets are hard at every instant. A move into a tier first reserves the partition's bytes
(`_reserve`), synchronously checking and adding in one step between awaits, so two concurrent
requests can never both see the same free space. Only then does the backend allocate. Bytes
return to the budget only after the backend's delete completed. When a request does not fit,
unpinned non-home copies chosen by the tier's policy are evicted (dirty ones written back
first); when pins keep it from fitting, the request waits for a change (a release, a finished
eviction), up to the manager's timeout. A request that can never fit (bigger than the budget
minus the bytes of the partitions whose home is that tier) fails at once with CapacityError.

[Note: versions]
Every write into a partition (`allocate`, `mark_dirty`) bumps its version. A move or write-back
records the version it started from; if the version moved on meanwhile, its result is not
marked valid (the bytes it copied may be torn), so a concurrent writer can never be overwritten
by an older copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tiered.device import default_device
from tiered.errors import CapacityError, StorageIOError, TierTimeoutError
from tiered.tiers.context import _mark, crc32_of, format_bytes, with_context
from tiered.tiers.loop import EventLoopThread
from tiered.tiers.partition import CopyState, Partition
from tiered.tiers.policy import EvictionPolicy, LRUPolicy
from tiered.tiers.stats import ManagerStats
from tiered.tiers.tier import Tier
from tiered.tiers.trace import TraceRecorder

log = logging.getLogger(__name__)
T = TypeVar("T")
A = CopyState


@dataclass
class TierState:
    tier: Tier
    budget: int | None
    memory_like: bool
    persistent: bool
    used: int = 0
    peak: int = 0
    home_bytes: int = 0
    policy: EvictionPolicy | None = None


class TierCore:
    """All mutable manager state and the coroutines that change it. See the Notes above."""

    def __init__(self, tiers: list[Tier], loop: EventLoopThread, *, timeout_s: float,
                 max_inflight_per_link: int, verify: bool, stats: ManagerStats, trace: TraceRecorder) -> None:
        self.order = [t.name for t in tiers]
        self.ts: dict[str, TierState] = {}
        for t in tiers:
            caps = t.backend.capabilities
            self.ts[t.name] = TierState(t, t.resolved_budget(), caps.memory_like, caps.persistent, policy=LRUPolicy())
        self.loop = loop
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight_per_link
        self.verify = verify
        self.stats = stats
        self.trace = trace
        self.parts: dict[str, Partition] = {}
        self._sems: dict[str, asyncio.Semaphore] = {}
        self._changed: asyncio.Event | None = None
        self._tick = 0
        self._sources: dict[tuple[str, str], int] = {}  # (partition, tier) -> moves reading that copy
        self._version: dict[str, int] = {}
        self._evict_version: dict[int, int] = {}

    # ---- small helpers ---------------------------------------------------------------------
    def notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_change(self, deadline: float, describe: Callable[[], str]) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        ev = self._changed
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise _mark(TierTimeoutError(describe()))
        try:
            await asyncio.wait_for(ev.wait(), remaining)
        except TimeoutError:
            raise _mark(TierTimeoutError(describe())) from None

    def deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.timeout_s

    def touch(self, part: Partition, tier: str) -> None:
        self._tick += 1
        part._last_use[tier] = self._tick

    def view(self, part: Partition, tier: str) -> torch.Tensor:
        return self.ts[tier].tier.backend.view(part.name)

    async def io(self, aw: Awaitable[T], what: str) -> T:
        """A backend call, bounded by the manager's timeout."""
        try:
            return await asyncio.wait_for(aw, self.timeout_s)
        except TimeoutError:
            raise _mark(TierTimeoutError(f"{what}: the backend did not answer within {self.timeout_s} s")) from None

    def ctx(self, part: Partition, tier: str, op: str) -> str:
        ts = self.ts[tier]
        return f"{op} of partition {part.name!r} in tier {tier!r} (backend {ts.tier.backend.name!r}, key {part.name!r})"

    def sources(self, part: Partition, tier: str) -> int:
        return self._sources.get((part.name, tier), 0)

    def version(self, part: Partition) -> int:
        return self._version.get(part.name, 0)

    def bump(self, part: Partition) -> None:
        self._version[part.name] = self.version(part) + 1

    # ---- budgets (see [Note: reserve before move]) -----------------------------------------
    def never_fits(self, ts: TierState, nbytes: int, part: Partition, op: str) -> CapacityError | None:
        if ts.budget is None:
            return None
        room = ts.budget - ts.home_bytes
        if nbytes <= room:
            return None
        return CapacityError(
            f"{op} of partition {part.name!r} ({format_bytes(nbytes)}) can never fit tier {ts.tier.name!r}: "
            f"budget {format_bytes(ts.budget)}, of which {format_bytes(ts.home_bytes)} is held by partitions "
            f"whose home is {ts.tier.name!r}; raise the tier's budget, move some partitions' home to a "
            "slower tier, or split the partition smaller"
        )

    def evictable(self, tier: str) -> list[Partition]:
        out = []
        for p in self.parts.values():
            st = p.state(tier)
            if (st in (A.VALID, A.DIRTY, A.STALE) and p.home != tier and p.pin_count(tier) == 0
                    and tier not in p._busy and self.sources(p, tier) == 0):
                out.append(p)
        return out

    async def reserve(self, tier: str, part: Partition, op: str) -> None:
        ts = self.ts[tier]
        nbytes = part.nbytes
        err = self.never_fits(ts, nbytes, part, op)
        if err is not None:
            raise _mark(err)
        deadline = self.deadline()
        while True:
            if ts.budget is None or ts.used + nbytes <= ts.budget:
                ts.used += nbytes
                ts.peak = max(ts.peak, ts.used)
                return
            need = ts.used + nbytes - ts.budget
            cands = self.evictable(tier)
            if cands:
                allowed = {id(p) for p in cands}
                chosen, freed = [], 0
                assert ts.policy is not None
                for p in ts.policy.choose(tier, cands, need):
                    if id(p) in allowed and freed < need:
                        allowed.discard(id(p))
                        chosen.append(p)
                        freed += p.nbytes
                # claim every chosen copy now, before any await, so no other request picks it too
                claims = [(p, *self.begin_evict(p, tier)) for p in chosen]
                results = await asyncio.gather(
                    *[self.finish_evict(p, tier, prev, fut) for p, prev, fut in claims], return_exceptions=True
                )
                for r in results:
                    if isinstance(r, BaseException):
                        raise r
                continue

            def describe() -> str:
                pinned = sum(p.nbytes for p in self.parts.values() if p.pin_count(tier) and p.home != tier)
                return (
                    f"{op} of partition {part.name!r} ({format_bytes(nbytes)}) waited {self.timeout_s} s for room in "
                    f"tier {tier!r}: budget {format_bytes(ts.budget or 0)}, in use {format_bytes(ts.used)} "
                    f"({format_bytes(pinned)} pinned by fetch/allocate, {format_bytes(ts.home_bytes)} home); "
                    "release() pinned partitions, or raise the tier's budget"
                )

            await self.wait_change(deadline, describe)

    def unreserve(self, tier: str, nbytes: int) -> None:
        ts = self.ts[tier]
        ts.used -= nbytes
        assert ts.used >= 0, f"tier {tier}: negative usage"
        self.notify()

    # ---- moves -----------------------------------------------------------------------------
    def link_sem(self, src: str, dst: str) -> asyncio.Semaphore:
        key = f"{src}->{dst}"
        sem = self._sems.get(key)
        if sem is None:
            sem = self._sems[key] = asyncio.Semaphore(self.max_inflight)
        return sem

    def source_of(self, part: Partition, exclude: str) -> str | None:
        for t in self.order:
            if t != exclude and part.state(t).readable:
                return t
        return None

    async def transfer(self, part: Partition, src: str, dst: str, op: str,
                       fill: Callable[[], Awaitable[Any]]) -> Any:
        """Run `fill` as one move on link src->dst: bounded concurrency, stats, trace."""
        # count the source as read before the first await, so no eviction can take it away
        key = (part.name, src)
        self._sources[key] = self._sources.get(key, 0) + 1
        sem = self.link_sem(src, dst)
        try:
            await asyncio.wait_for(sem.acquire(), self.timeout_s)
        except BaseException as exc:
            self._drop_source(key)
            if isinstance(exc, TimeoutError):
                raise _mark(TierTimeoutError(
                    f"{op} of partition {part.name!r}: link {src}->{dst} stayed busy for {self.timeout_s} s"
                )) from None
            raise
        link = self.stats.link(src, dst)
        link.begin()
        t0 = time.perf_counter()
        ok = False
        try:
            out = await fill()
            ok = True
            return out
        except BaseException as exc:
            sb, db = self.ts[src].tier.backend, self.ts[dst].tier.backend
            err = with_context(exc, (
                f"{op} of partition {part.name!r}: move {src}->{dst} failed (key {part.name!r}; "
                f"source backend {sb.name!r}, destination backend {db.name!r})"
            ))
            if err is exc:
                raise
            raise err from exc
        finally:
            t1 = time.perf_counter()
            link.end(part.nbytes, ok)
            sem.release()
            self._drop_source(key)
            if ok:
                self.stats.tiers[src].reads += 1
                self.stats.tiers[dst].writes += 1
                self.trace.add(part.name, f"{src}->{dst}", t0, t1, bytes=part.nbytes, op=op)
            if part.state(src) is A.STALE:
                self.maybe_free_stale(part, src)
            self.notify()

    def _drop_source(self, key: tuple[str, str]) -> None:
        n = self._sources[key] - 1
        if n:
            self._sources[key] = n
        else:
            del self._sources[key]

    async def mem_copy(self, dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
        """Copy between resident tensors: host copies in the pool, device copies on the side
        stream of the one device object (see [Note: one device object] in tiered.device)."""
        if dst.device.type == "cpu" and src.device.type == "cpu":
            await self.loop.run_blocking(dst.copy_, src)
            return
        dev = default_device()
        event = dev.copy_async(dst, src)
        await dev.wait(event, timeout_s=self.timeout_s, what=what)

    async def copy_into(self, part: Partition, src: str, dst: str, buf: torch.Tensor, op: str) -> None:
        """Fill resident `buf` (in memory-like `dst`) from `src`'s copy, verifying if asked."""
        sts = self.ts[src]

        async def fill() -> None:
            if sts.memory_like:
                await self.mem_copy(buf, self.view(part, src), self.ctx(part, src, op))
                return
            await self.io(sts.tier.backend.read(part.name, buf), self.ctx(part, src, op))
            want = part.checksum(src)
            if self.verify and sts.persistent and want is not None:
                got = await self.loop.run_blocking(crc32_of, buf)
                if got != want:
                    raise _mark(StorageIOError(
                        f"{self.ctx(part, src, op)}: checksum mismatch reading into tier {dst!r} "
                        f"(crc32 {got:#010x}, expected {want:#010x}); the stored copy is corrupt - "
                        "restore it from a checkpoint"
                    ))

        await self.transfer(part, src, dst, op, fill)

    async def write_to(self, part: Partition, src: str, dst: str, op: str) -> None:
        """Write `src`'s resident copy into `dst`'s storage (a write-back to home)."""
        dts = self.ts[dst]
        srcbuf = self.view(part, src)

        async def fill() -> None:
            if dts.memory_like:
                await self.mem_copy(self.view(part, dst), srcbuf, self.ctx(part, dst, op))
                return
            jobs: list[Awaitable[Any]] = [self.io(dts.tier.backend.write(part.name, srcbuf), self.ctx(part, dst, op))]
            if dts.persistent:
                jobs.append(self.loop.run_blocking(crc32_of, srcbuf))
            res = await asyncio.gather(*jobs)
            part._set_checksum(dst, res[1] if dts.persistent else None)

        await self.transfer(part, src, dst, op, fill)

    async def load(self, part: Partition, tier: str, op: str) -> None:
        """Bring the newest bytes into memory-like `tier` (absent or stale there). Shared by waiters."""
        fut = asyncio.get_running_loop().create_future()
        part._busy[tier] = fut
        reused = part.state(tier) is A.STALE
        reserved = allocated = False
        backend = self.ts[tier].tier.backend
        try:
            part._set(tier, A.LOADING)
            if not reused:
                await self.reserve(tier, part, op)
                reserved = True
            deadline = self.deadline()
            while (src := self.source_of(part, tier)) is None:
                # the newest bytes are mid write-back (an eviction in flight): wait for it to land
                await self.wait_change(deadline, lambda: f"{op} of partition {part.name!r}: no valid copy appeared")
            version = self.version(part)
            if reused:
                buf = backend.view(part.name)
            else:
                buf = backend.allocate(part.name, part.numel, part.dtype)
                allocated = True
            await self.copy_into(part, src, tier, buf, op)
            if self.version(part) != version:
                part._set(tier, A.STALE)  # a writer moved on during the copy: retry (see [Note: versions])
            else:
                part._set(tier, A.DIRTY if part.state(part.home) is A.STALE else A.VALID)
            fut.set_result(None)
        except BaseException as exc:
            err = with_context(exc, self.ctx(part, tier, op))
            cancelled = isinstance(exc, asyncio.CancelledError)
            if reused:
                part._set(tier, A.STALE)
            else:
                part._set(tier, A.ABSENT)
                if allocated:
                    try:
                        await self.io(backend.delete(part.name), self.ctx(part, tier, "cleanup"))
                    except Exception:
                        log.warning("could not free %s after a failed %s", self.ctx(part, tier, "buffer"), op)
                if reserved:
                    self.unreserve(tier, part.nbytes)
            if cancelled:
                fut.cancel()
            else:
                fut.set_exception(err)
                fut.exception()  # retrieved: waiters re-raise it, nobody else must log it
            if err is exc:
                raise
            raise err from exc
        finally:
            part._busy.pop(tier, None)
            self.notify()

    async def writeback(self, part: Partition, src: str | None = None, op: str = "write-back") -> bool:
        """Write the newest (dirty) bytes back to home; afterwards every copy is clean."""
        home = part.home
        deadline = self.deadline()
        while True:
            busy = part._busy.get(home)
            if busy is not None:
                remaining = deadline - asyncio.get_running_loop().time()
                try:
                    await asyncio.wait_for(asyncio.shield(busy), max(0.0, remaining))
                except TimeoutError:
                    raise _mark(TierTimeoutError(
                        f"{op} of partition {part.name!r}: a write-back to home {home!r} ran past {self.timeout_s} s"
                    )) from None
                continue
            if part.state(home) is not A.STALE:
                return False
            if src is None:
                src = next((t for t in self.order if part.state(t) is A.DIRTY), None)
            if src is not None:
                break
            # the newest bytes are in a copy being evicted, whose own write-back is about to start
            await self.wait_change(deadline, lambda: f"{op} of partition {part.name!r}: no dirty copy to write back")
        fut = asyncio.get_running_loop().create_future()
        part._busy[home] = fut
        try:
            version = self.version(part)
            await self.write_to(part, src, home, op)
            if self.version(part) == version:
                part._set(home, A.VALID)
                for t, st in part.copies().items():
                    if st is A.DIRTY:
                        part._set(t, A.VALID)
            self.stats.writebacks += 1
            fut.set_result(None)
            return True
        except BaseException as exc:
            fut.set_result(None)  # waiters re-check the state; the error goes to this caller
            err = with_context(exc, self.ctx(part, home, op))
            if err is exc:
                raise
            raise err from exc
        finally:
            part._busy.pop(home, None)
            self.notify()

    def begin_evict(self, part: Partition, tier: str) -> tuple[CopyState, asyncio.Future[None]]:
        """Claim an unpinned, idle, non-home copy for eviction, synchronously (no await)."""
        prev = part.state(tier)
        assert prev in (A.VALID, A.DIRTY, A.STALE) and tier != part.home, (part, tier)
        assert tier not in part._busy, (part, tier)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        part._busy[tier] = fut
        part._set(tier, A.EVICTING)
        self._evict_version[id(fut)] = self.version(part)
        return prev, fut

    async def finish_evict(self, part: Partition, tier: str, prev: CopyState, fut: asyncio.Future[None]) -> None:
        """Write the claimed copy back if it is dirty, then delete it and return its budget."""
        try:
            if prev is A.DIRTY:
                # if a writer moved on meanwhile, a newer dirty copy lives elsewhere: ours is stale.
                # Every DIRTY copy holds the newest bytes (a write leaves one, a move from it
                # another), so while another one stays it carries the write-back: a gpu copy
                # gathered from a dirty cpu copy is then dropped, not written to NVMe as well
                others_dirty = any(st is A.DIRTY for t, st in part.copies().items() if t != tier)
                if (part.state(part.home) is A.STALE and not others_dirty
                        and self.version(part) == self._evict_version.get(id(fut))):
                    await self.writeback(part, src=tier, op="evict write-back")
                elif others_dirty:
                    self.stats.clean_drops += 1
                prev = A.VALID
            else:
                self.stats.clean_drops += 1
            backend = self.ts[tier].tier.backend
            await self.io(backend.delete(part.name), self.ctx(part, tier, "evict"))
            part._set(tier, A.ABSENT)
            self.stats.evictions += 1
            self.unreserve(tier, part.nbytes)
        except BaseException as exc:
            part._set(tier, prev)
            err = with_context(exc, self.ctx(part, tier, "evict"))
            if err is exc:
                raise
            raise err from exc
        finally:
            self._evict_version.pop(id(fut), None)
            fut.set_result(None)
            part._busy.pop(tier, None)
            self.notify()

    async def evict_copy(self, part: Partition, tier: str) -> None:
        prev, fut = self.begin_evict(part, tier)
        await self.finish_evict(part, tier, prev, fut)

    def invalidate_others(self, part: Partition, tier: str) -> None:
        """`tier` now holds the only newest bytes: the rest become stale (freed when unpinned)."""
        self.bump(part)
        for t, st in part.copies().items():
            if t == tier or st is A.ABSENT:
                continue
            if t == part.home:
                part._set(t, A.STALE)
                part._set_checksum(t, None)
            elif st in (A.VALID, A.DIRTY):
                part._set(t, A.STALE)
                self.maybe_free_stale(part, t)
            # LOADING / EVICTING copies notice the version change themselves
        part._set(tier, A.VALID if tier == part.home else A.DIRTY)

    def maybe_free_stale(self, part: Partition, tier: str) -> None:
        if (part.state(tier) is A.STALE and tier != part.home and part.pin_count(tier) == 0
                and tier not in part._busy and self.sources(part, tier) == 0):
            prev, fut = self.begin_evict(part, tier)
            task = asyncio.get_running_loop().create_task(self.finish_evict(part, tier, prev, fut))
            task.add_done_callback(_log_failure)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("freeing a stale copy failed: %s", task.exception())
