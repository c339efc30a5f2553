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
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

import torch

from tiered.device import default_device
from tiered.errors import StoredSizeError
from tiered.tiers.budget import TierBudget
from tiered.tiers.checksum import (
    SERIAL_PIECES,
    check_digest,
    combine,
    digest_of,
    host_bytes,
    piece_digest,
    pieces,
    truncated,
)
from tiered.tiers.error_context import raise_in_context, where
from tiered.tiers.io_policy import IOCounters, IOPolicy, with_retries
from tiered.tiers.loop import EventLoopThread
from tiered.tiers.partition import Partition
from tiered.tiers.stats import ManagerStats
from tiered.tiers.trace import TraceRecorder
from tiered.tiers.waiting import bounded

T = TypeVar("T")
log = logging.getLogger(__name__)


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
        policy: IOPolicy | None = None,
    ) -> None:
        self._tiers = tiers
        self.loop = loop
        self.timeout_s = timeout_s
        self.policy = policy if policy is not None else IOPolicy(timeout_s=timeout_s)
        self.counters: IOCounters = stats.io
        self.max_inflight = max_inflight_per_link
        self.verify = verify
        self.stats = stats
        self.trace = trace
        self._sems: dict[str, asyncio.Semaphore] = {}

    def ctx(self, part: Partition, tier: str, op: str) -> str:
        return where(op, part.name, tier, self._tiers[tier].backend.name)

    async def io(
        self, call: Callable[[], Awaitable[T]], what: str, nbytes: int = 0, *, retry: bool = True
    ) -> T:
        """One backend call: each try bounded by the byte-scaled timeout; transient errors of an
        idempotent call (a read, a whole-object write: `retry`) tried again
        ([Note: byte-scaled I/O timeouts], [Note: retries of transient errors] in
        `tiered.tiers.io_policy`)."""
        policy = self.policy if retry else replace(self.policy, retries=0)

        async def one_try() -> T:
            try:
                return await bounded(
                    call(),
                    policy.bound_s(nbytes),
                    lambda: f"{what}: the backend did not answer within {policy.describe_bound(nbytes)}",
                )
            except TimeoutError:
                self.counters.timeouts += 1
                raise

        def on_retry(attempt: int, exc: BaseException) -> None:
            log.warning("%s: transient error, retry %d of %d: %s", what, attempt + 1, policy.retries, exc)

        try:
            return await with_retries(one_try, policy, self.counters, on_retry)
        except OSError as exc:
            n = getattr(exc, "_tiered_retries", 0)
            if not n:
                raise
            raise_in_context(exc, f"{what} (gave up after {n} retries, tiered.io_retries = {policy.retries})")

    async def checksum(self, buf: torch.Tensor) -> int:
        """The digest of `buf` ([Note: partition checksums]), its pieces hashed in parallel on
        the bridge, so a read waits a fraction of one thread's hashing time."""
        b = host_bytes(buf) if buf.device.type == "cpu" else await self.loop.run_blocking(host_bytes, buf)
        spans = pieces(b.numel())
        if len(spans) <= SERIAL_PIECES:
            return await self.loop.run_blocking(digest_of, b)
        got = await asyncio.gather(*(self.loop.run_blocking(piece_digest, b, o, n) for o, n in spans))
        return combine(list(got))

    def _link_sem(self, src: str, dst: str) -> asyncio.Semaphore:
        key = f"{src}->{dst}"
        sem = self._sems.get(key)
        if sem is None:
            sem = self._sems[key] = asyncio.Semaphore(self.link_bound(src, dst))
        return sem

    def link_bound(self, src: str, dst: str) -> int:
        """Moves in flight on src->dst at most: ``max_inflight_per_link``, lowered to what either
        end declares it takes at once (`Capabilities.max_concurrency`, docs/backends.md)."""
        declared = [self._tiers[t].max_concurrency for t in (src, dst)]
        return min([self.max_inflight, *(d for d in declared if d > 0)])

    async def run(self, part: Partition, src: str, dst: str, op: str, fill: Callable[[], Awaitable[T]]) -> T:
        """Run `fill` as one move on link src->dst: bounded concurrency, stats, trace, context."""
        sem = self._link_sem(src, dst)
        await bounded(
            sem.acquire(),
            self.timeout_s,
            lambda: (
                f"{op} of partition {part.name!r} from tier {src!r} to tier {dst!r} (backends "
                f"{self._tiers[src].backend.name!r} -> {self._tiers[dst].backend.name!r}, key {part.name!r}): "
                f"link {src}->{dst} stayed busy for {self.timeout_s} s, the moves ahead on it did not finish"
            ),
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
            what = self.ctx(part, src, op)
            try:
                await self.io(lambda: sts.backend.read(part.name, buf), what, part.nbytes)
            except StoredSizeError as exc:
                # the manager always reads exactly the partition's bytes: a size mismatch is a
                # truncated or overwritten file, not a caller's mistake ([Note: partition checksums])
                self.counters.truncated += 1
                raise truncated(
                    what, dst, sts.backend.locate(part.name), exc.stored_nbytes, part.nbytes
                ) from exc
            want = part.checksum(src)
            if self.verify and want is not None:
                got = await self.checksum(buf)
                self.counters.verified_reads += 1
                self.counters.verified_bytes += part.nbytes
                if got != want:
                    self.counters.checksum_failures += 1
                check_digest(got, want, what, dst, sts.backend.locate(part.name))

        await self.run(part, src, dst, op, fill)

    async def write_from(self, part: Partition, src: str, dst: str, op: str) -> int | None:
        """Write `src`'s resident copy into `dst`'s storage (a write-back to home); the digest of
        what was written when `dst` is not memory-like and verification is on, for the caller
        to record ([Note: partition checksums])."""
        dts = self._tiers[dst]
        srcbuf = self._tiers[src].backend.view(part.name)
        verify = self.verify  # read once: the digest returned is the one of this write, or None

        async def fill() -> int | None:
            if dts.memory_like:
                await self.mem_copy(dts.backend.view(part.name), srcbuf, self.ctx(part, dst, op))
                return None
            jobs: list[Awaitable[Any]] = [
                self.io(lambda: dts.backend.write(part.name, srcbuf), self.ctx(part, dst, op), part.nbytes)
            ]
            if verify:
                jobs.append(self.checksum(srcbuf))
            res = await asyncio.gather(*jobs)
            return res[1] if verify else None

        return await self.run(part, src, dst, op, fill)
