"""`TierStateMachine`: every operation of the tier manager, as coroutines on its loop thread.

It is the only writer of partition state (through `Partition`'s transitions) and of budget state
(`TierBudget`); `TierManager` is a thread-safe facade that submits these coroutines, and
`Transfers` only copies bytes.

[Note: reserve before move]
Budgets are hard at every instant. A move into a tier first reserves the partition's bytes
(`_reserve`), synchronously checking and adding in one step between awaits, so two concurrent
requests can never both see the same free space. Only then does the backend allocate. Bytes
return to the budget only after the backend's delete completed. When a request does not fit,
unpinned non-home copies chosen by the tier's policy are evicted (dirty ones written back
first), the copies kept in that tier after all the others ([Note: kept copies] in
tiered/tiers/partition.py: the policy orders each of the two sets, never one across both); when pins keep it from fitting, the request waits for a change (a release, a finished
eviction), up to the manager's timeout. A request that can never fit (bigger than the budget
minus the bytes of the partitions whose home is that tier) fails at once with CapacityError.

[Note: versions]
Every write into a partition (`allocate`, `mark_dirty`) bumps its version. A move or write-back
records the version it started from; if the version moved on meanwhile, its result is not
marked valid (the bytes it copied may be torn), so a concurrent writer can never be overwritten
by an older copy.

[Note: direct home I/O]
A checkpoint copies a partition whose home is a file (an NVMe swap file) file to file in bounded
chunks, never whole in RAM, so it reads and replaces the stored object itself rather than through
a move. `claim_home` holds the home copy for that: for a read, once home is readable and no
write-back is in flight (a faster dirty copy means home is stale: read that one instead); for a
write, once nothing reads or writes home. While claimed, home counts as busy, so no write-back,
refresh or drop lands on it. A writer prepares the new bytes beside the stored object and
`commit_home` makes them the partition's newest value in one step: once no move reads home, home
is hidden (LOADING) while the backend adopts the caller's file (`StorageBackend.adopt_file`, an
atomic rename its index learns of), then the
version moves on, every other copy goes stale and home is VALID with the digest of what was
written. Until the commit the old bytes stay whole and readable, and `release_home` without a
commit changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch

from tiered.errors import PinnedError
from tiered.tiers.budget import TierBudget
from tiered.tiers.error_context import mark, raise_in_context, rethrow, with_context
from tiered.tiers.partition import CopyState, Partition
from tiered.tiers.policy import EvictionPolicy
from tiered.tiers.transfer import Transfers
from tiered.tiers.waiting import ChangeSignal, close_all, deadline_after, outside_request, wait_done

log = logging.getLogger(__name__)
T = TypeVar("T")
ABSENT, VALID, DIRTY, STALE = CopyState.ABSENT, CopyState.VALID, CopyState.DIRTY, CopyState.STALE


def check_managed(parts: dict[str, Partition], part: Partition) -> None:
    if parts.get(part.name) is not part:
        raise ValueError(
            f"partition {part.name!r} is not managed here (it was dropped, or belongs to another manager)"
        )


class TierStateMachine:
    """The partitions and budgets of one manager and the coroutines that change them."""

    def __init__(self, tiers: dict[str, TierBudget], transfers: Transfers, timeout_s: float) -> None:
        self.order = list(tiers)
        self.tiers = tiers
        self.parts: dict[str, Partition] = {}
        self.transfers = transfers
        self.stats = transfers.stats
        self.timeout_s = timeout_s
        self._changed = ChangeSignal()
        self._tick = 0

    # ---- operations (the facade's, one each) -----------------------------------------------
    async def create(self, part: Partition, init: torch.Tensor | None) -> None:
        home = part.home
        if part.name in self.parts:
            raise ValueError(f"partition {part.name!r} already exists; names must be unique (drop it first)")
        ts = self.tiers[home]
        err = ts.never_fits(part.nbytes, part.name, "create")
        if err is not None:
            raise mark(err)
        self.parts[part.name] = part
        fut = asyncio.get_running_loop().create_future()
        part.start_load(home, fut)
        version, reserved = part.version, False
        try:
            await self._reserve(home, part, "create")
            reserved = True
            ts.home_bytes += part.nbytes
            if ts.memory_like:
                buf = ts.backend.allocate(part.name, part.numel, part.dtype)
                await self.transfers.loop.run_blocking(_fill, buf, init)
            else:
                src = init.contiguous() if init is not None else ts.aligned_zeros(part.numel, part.dtype)
                await self.transfers.io(
                    lambda: ts.backend.write(part.name, src),
                    self.transfers.ctx(part, home, "create"),
                    part.nbytes,
                )
                if self.transfers.verify:
                    part.set_checksum(home, await self.transfers.checksum(src))
            self.stats.tiers[home].writes += 1
            part.end_load(home, version)
        except BaseException as exc:  # noqa: BLE001 - undo the creation whatever stopped it, then re-raise
            part.fail_load(home, reused=False)
            self.parts.pop(part.name, None)
            if reserved:
                ts.home_bytes -= part.nbytes
                self._unreserve(home, part.nbytes)
            raise_in_context(exc, self.transfers.ctx(part, home, "create"))
        finally:
            part.moves.end(home)
            if not fut.done():
                fut.set_result(None)
            self._changed.notify()

    def _at(self, part: Partition, tier: str) -> str:
        """The backend and key of `part`'s copy in `tier`, for a message ([Note: error context])."""
        return f"(backend {self.tiers[tier].backend.name!r}, key {part.name!r})"

    def pin_if_resident(self, part: Partition, tier: str) -> torch.Tensor | None:
        """[Note: fetch fast path]: pin a copy already resident with one plain call on the loop."""
        if self.parts.get(part.name) is not part or not part.state(tier).readable:
            return None
        part.pin(tier, +1, self._next_tick())
        return self.tiers[tier].backend.view(part.name)

    async def ensure(self, part: Partition, tier: str, *, pin: bool, op: str) -> torch.Tensor:
        """Make `part` resident in `tier` (fetch, prefetch), pinned if asked."""
        deadline = deadline_after(self.timeout_s)
        while True:
            check_managed(self.parts, part)
            if part.state(tier).readable:
                if pin:
                    part.pin(tier, +1, self._next_tick())
                else:
                    part.touch(tier, self._next_tick())
                return self.tiers[tier].backend.view(part.name)
            busy = part.moves.busy(tier)
            if busy is not None:
                await wait_done(
                    busy,
                    deadline,
                    lambda: (
                        f"{op} of partition {part.name!r} to tier {tier!r} {self._at(part, tier)}: a move "
                        f"in flight there ran past {self.timeout_s} s (tiered.timeout_s)"
                    ),
                )
                continue
            if tier == part.home:  # home is stale: a faster copy is dirty; bring it home
                await self._writeback(part, op=f"{op} (home refresh)")
                continue
            await self._load(part, tier, op)

    async def allocate(self, part: Partition, tier: str) -> torch.Tensor:
        """A pinned buffer in `tier` the caller fully overwrites: no read; it is the only newest copy."""
        deadline = deadline_after(self.timeout_s)
        while (busy := part.moves.busy(tier)) is not None:
            try:
                await wait_done(
                    busy,
                    deadline,
                    lambda: (
                        f"allocate of partition {part.name!r} in tier {tier!r} {self._at(part, tier)}: a "
                        f"move in flight there ran past {self.timeout_s} s (tiered.timeout_s)"
                    ),
                )
            except TimeoutError:
                raise
            except Exception:  # noqa: BLE001 - a failed load left the copy absent: allocate it ourselves
                pass  # a failed load left the copy absent: allocate it ourselves
        check_managed(self.parts, part)
        if part.state(tier) is ABSENT:
            fut = asyncio.get_running_loop().create_future()
            part.start_load(tier, fut)
            try:
                await self._reserve(tier, part, "allocate")
                try:
                    self.tiers[tier].backend.allocate(part.name, part.numel, part.dtype)
                except BaseException:
                    self._unreserve(tier, part.nbytes)
                    raise
            except BaseException as exc:  # noqa: BLE001 - undo the load whatever stopped it, then re-raise in context
                part.fail_load(tier, reused=False)
                raise_in_context(exc, self.transfers.ctx(part, tier, "allocate"))
            finally:
                part.moves.end(tier)
                fut.set_result(None)
                self._changed.notify()
        part.pin(tier, +1, self._next_tick())
        self._wrote(part, tier)
        return self.tiers[tier].backend.view(part.name)

    def release(self, part: Partition, tier: str) -> None:
        if part.pin_count(tier) <= 0:
            raise ValueError(
                f"release of partition {part.name!r} in tier {tier!r}: it is not pinned there "
                "(each release must match one fetch or allocate)"
            )
        part.pin(tier, -1, self._next_tick())
        self._free_if_stale(part, tier)
        self._changed.notify()

    def mark_dirty(self, part: Partition, tier: str) -> None:
        check_managed(self.parts, part)
        if not part.state(tier).readable:
            raise ValueError(
                f"mark_dirty of partition {part.name!r} in tier {tier!r}: no valid copy is resident there "
                f"(state {part.state(tier).value}); fetch or allocate it first"
            )
        self._wrote(part, tier)
        self._changed.notify()

    async def evict(self, part: Partition, tier: str, *, discard: bool = False) -> None:
        """Remove the copy in `tier`, written back first if it is the dirty newest one; with
        `discard` never written back: its bytes are dead and the home's are the value again
        ([Note: discarded copies] in tiered/tiers/manager.py)."""
        deadline = deadline_after(self.timeout_s)
        while True:
            check_managed(self.parts, part)
            if part.pin_count(tier):
                raise mark(
                    PinnedError(
                        f"evict of partition {part.name!r} from tier {tier!r}: it is pinned "
                        f"({part.pin_count(tier)} fetch/allocate not yet released); release() it first"
                    )
                )
            if part.moves.busy(tier) is None and part.moves.readers(tier) == 0:
                break
            await self._changed.wait(
                deadline,
                lambda: (
                    f"evict of partition {part.name!r} from tier {tier!r} {self._at(part, tier)}: "
                    f"a move on that copy ran past {self.timeout_s} s (tiered.timeout_s)"
                ),
            )
        if part.state(tier) is ABSENT:
            return
        if discard and part.state(tier) is DIRTY and part.state(part.home) is STALE:
            if not any(st is DIRTY for t, st in part.copies().items() if t != tier):
                part.written_back(part.version)  # nothing lands: the home's bytes stand
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._finish_evict(part, tier, part.claim_eviction(tier, fut), fut)

    def keep(self, part: Partition, tier: str, kept: bool) -> None:
        """[Note: kept copies]: `part`'s copy in `tier` stays across uses (or no longer does)."""
        check_managed(self.parts, part)
        part.set_kept(tier, kept)

    async def settle(self, part: Partition, tier: str) -> None:
        """The caller is done with `part`'s copy in `tier`: evicted (written home first when
        dirty) unless the partition is kept there ([Note: kept copies])."""
        check_managed(self.parts, part)
        if part.is_kept(tier):
            part.touch(tier, self._next_tick())
            return
        await self.evict(part, tier)

    async def flush(self, part: Partition | None) -> None:
        parts = [part] if part is not None else list(self.parts.values())
        results = await asyncio.gather(
            *[self._writeback(p, op="flush") for p in parts if p.state(p.home) is STALE],
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if len(errors) > 1:
                log.error("flush: %d partitions failed to write back; first: %s", len(errors), errors[0])
            raise errors[0]

    async def drop(self, part: Partition) -> None:
        deadline = deadline_after(self.timeout_s)
        while part.moves.any():
            await self._changed.wait(
                deadline,
                lambda: f"drop of partition {part.name!r}: moves still in flight after {self.timeout_s} s",
            )
        check_managed(self.parts, part)
        pinned = {t: n for t, n in part.pins().items() if n}
        if pinned:
            raise mark(
                PinnedError(f"drop of partition {part.name!r}: still pinned in {pinned}; release() first")
            )
        self.parts.pop(part.name, None)
        errors = []
        for t, st in list(part.copies().items()):
            if st is ABSENT:
                continue
            try:
                await self.transfers.io(
                    partial(self.tiers[t].backend.delete, part.name),
                    self.transfers.ctx(part, t, "drop"),
                    retry=False,
                )
            except Exception as exc:  # noqa: BLE001 - keep going: the budget must come back even if a file lingers
                errors.append(with_context(exc, self.transfers.ctx(part, t, "drop")))
            part.end_eviction(t, ABSENT)
            self._unreserve(t, part.nbytes)
        self.tiers[part.home].home_bytes -= part.nbytes
        self._changed.notify()
        if errors:
            raise errors[0]

    # ---- direct home I/O (see [Note: direct home I/O]) -------------------------------------
    async def claim_home(self, part: Partition, *, write: bool) -> HomeClaim | None:
        """Hold `part`'s home copy for the caller's own I/O; None for a read while home is stale."""
        home = part.home
        deadline = deadline_after(self.timeout_s)
        while True:
            check_managed(self.parts, part)
            idle = part.moves.busy(home) is None
            if idle and not write and not part.state(home).readable:
                return None
            if idle and (not write or part.moves.readers(home) == 0):
                break
            await self._changed.wait(
                deadline,
                lambda: (
                    f"claim of partition {part.name!r}'s home {home!r}: still busy after {self.timeout_s} s"
                ),
            )
        part.moves.claim(home, asyncio.get_running_loop().create_future())
        return HomeClaim(part, write, part.checksum(home))

    async def commit_home(self, claim: HomeClaim, source: str, checksum: int | None) -> None:
        """Make the complete file `source` home's stored object and newest value, then release
        the claim."""
        part, home = claim.part, claim.part.home
        assert claim.write and part.moves.busy(home) is not None
        deadline = deadline_after(self.timeout_s)
        while part.moves.readers(home):
            await self._changed.wait(
                deadline,
                lambda: (
                    f"commit of partition {part.name!r}'s home {home!r}: still read after {self.timeout_s} s"
                ),
            )
        prev = part.state(home)
        part.end_eviction(home, CopyState.LOADING)  # hidden: no move picks it as a source meanwhile
        try:
            await self.tiers[home].backend.adopt_file(part.name, source)
        except BaseException:
            part.end_eviction(home, prev)  # the old bytes are still whole
            self.release_home(claim)
            raise
        self._wrote(part, home)  # a new version: every other copy is stale now
        part.set_checksum(home, checksum if self.transfers.verify else None)
        self.release_home(claim)

    def release_home(self, claim: HomeClaim) -> None:
        fut = claim.part.moves.end(claim.part.home)
        if fut is not None and not fut.done():
            fut.set_result(None)
        self._changed.notify()

    def set_policy(self, tier: str, policy: EvictionPolicy) -> None:
        # a plain attribute swap from any thread: the loop reads it once per eviction round
        self.tiers[tier].policy = policy

    # ---- budgets (see [Note: reserve before move]) -----------------------------------------
    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _evictable(self, tier: str) -> list[Partition]:
        return [p for p in self.parts.values() if p.state(tier) in (VALID, DIRTY, STALE) and p.can_free(tier)]

    async def _reserve(self, tier: str, part: Partition, op: str) -> None:
        ts = self.tiers[tier]
        nbytes = part.nbytes
        err = ts.never_fits(nbytes, part.name, op)
        if err is not None:
            raise mark(err)
        deadline = deadline_after(self.timeout_s)
        while not ts.try_take(nbytes):
            need = ts.shortfall(nbytes)
            cands = self._evictable(tier)
            if cands:
                allowed = {id(p) for p in cands}
                chosen, freed = [], 0
                assert ts.policy is not None
                # [Note: kept copies]: the kept ones go only once no other copy is left to free
                ordered = list(ts.policy.choose(tier, [p for p in cands if not p.is_kept(tier)], need))
                ordered += ts.policy.choose(tier, [p for p in cands if p.is_kept(tier)], need)
                for p in ordered:
                    if id(p) in allowed and freed < need:
                        allowed.discard(id(p))
                        chosen.append(p)
                        freed += p.nbytes
                # claim every chosen copy now, before any await, so no other request picks it too
                futs = [asyncio.get_running_loop().create_future() for _ in chosen]
                claims = [(p, p.claim_eviction(tier, f), f) for p, f in zip(chosen, futs, strict=True)]
                self.stats.kept_evictions += sum(p.is_kept(tier) for p in chosen)
                results = await asyncio.gather(
                    *[self._finish_evict(p, tier, prev, f) for p, prev, f in claims], return_exceptions=True
                )
                for r in results:
                    if isinstance(r, BaseException):
                        raise r
                continue

            def describe() -> str:
                pinned = sum(p.nbytes for p in self.parts.values() if p.pin_count(tier) and p.home != tier)
                return ts.no_room(op, part.name, nbytes, pinned, self.timeout_s)

            await self._changed.wait(deadline, describe)

    def _unreserve(self, tier: str, nbytes: int) -> None:
        self.tiers[tier].give_back(nbytes)
        self._changed.notify()

    # ---- moves -----------------------------------------------------------------------------
    def _source_of(self, part: Partition, exclude: str) -> str | None:
        return next((t for t in self.order if t != exclude and part.state(t).readable), None)

    async def _move(self, part: Partition, src: str, run: Callable[[], Awaitable[T]]) -> T:
        """One transfer reading `src`'s copy: counted as read before the first await, so no
        eviction takes it away; a stale source left behind is freed afterwards."""
        part.moves.add_reader(src)
        try:
            return await run()
        finally:
            part.moves.drop_reader(src)
            if part.state(src) is STALE:
                self._free_if_stale(part, src)
            self._changed.notify()

    async def _load(self, part: Partition, tier: str, op: str) -> None:
        """Bring the newest bytes into memory-like `tier` (absent or stale there). Shared by waiters."""
        fut = asyncio.get_running_loop().create_future()
        reused = part.start_load(tier, fut)
        reserved = allocated = False
        backend = self.tiers[tier].backend
        try:
            if not reused:
                await self._reserve(tier, part, op)
                reserved = True
            deadline = deadline_after(self.timeout_s)
            while (src := self._source_of(part, tier)) is None:
                # the newest bytes are mid write-back (an eviction in flight): wait for it to land
                await self._changed.wait(
                    deadline, lambda: f"{op} of partition {part.name!r}: no valid copy appeared"
                )
            version = part.version
            # what a waiter that times out on this load names ([Note: one deadline per request])
            fut.tiered_move = f"{self.transfers.ctx(part, src, op)}, moving {src}->{tier}"  # type: ignore[attr-defined]
            if reused:
                buf = backend.view(part.name)
            else:
                buf = backend.allocate(part.name, part.numel, part.dtype)
                allocated = True
            await self._move(part, src, lambda: self.transfers.read_into(part, src, tier, buf, op))
            part.end_load(tier, version)  # STALE if a writer moved on: the caller retries
            fut.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - undo the load whatever stopped it (cancellation too), then re-raise
            err = with_context(exc, self.transfers.ctx(part, tier, op))
            part.fail_load(tier, reused)
            if not reused:
                if allocated:
                    try:
                        with outside_request():
                            await self.transfers.io(
                                lambda: backend.delete(part.name),
                                self.transfers.ctx(part, tier, "cleanup"),
                                retry=False,
                            )
                    except Exception:  # noqa: BLE001 - the original failure is the one to report
                        log.warning(
                            "could not free %s after a failed %s",
                            self.transfers.ctx(part, tier, "buffer"),
                            op,
                        )
                if reserved:
                    self._unreserve(tier, part.nbytes)
            if isinstance(exc, asyncio.CancelledError):
                fut.cancel()
            else:
                fut.set_exception(err)
                fut.exception()  # retrieved: waiters re-raise it, nobody else must log it
            rethrow(err, exc)
        finally:
            part.moves.end(tier)
            self._changed.notify()

    async def _writeback(self, part: Partition, src: str | None = None, op: str = "write-back") -> bool:
        """Write the newest (dirty) bytes back to home; afterwards every copy is clean."""
        home = part.home
        deadline = deadline_after(self.timeout_s)
        while True:
            busy = part.moves.busy(home)
            if busy is not None:
                await wait_done(
                    busy,
                    deadline,
                    lambda: (
                        f"{op} of partition {part.name!r}: a write-back to home "
                        f"{home!r} {self._at(part, home)} ran past {self.timeout_s} s (tiered.timeout_s)"
                    ),
                )
                continue
            if part.state(home) is not STALE:
                return False
            if src is None:
                src = next((t for t in self.order if part.state(t) is DIRTY), None)
            if src is not None:
                break
            # the newest bytes are in a copy being evicted, whose own write-back is about to start
            await self._changed.wait(
                deadline, lambda: f"{op} of partition {part.name!r}: no dirty copy to write back"
            )
        fut = asyncio.get_running_loop().create_future()
        part.moves.claim(home, fut)
        try:
            version = part.version
            crc = await self._move(part, src, lambda: self.transfers.write_from(part, src, home, op))
            part.set_checksum(home, crc)
            part.written_back(version)
            self.stats.writebacks += 1
            fut.set_result(None)
            return True
        except BaseException as exc:  # noqa: BLE001 - wake the waiters whatever stopped it, then re-raise in context
            fut.set_result(None)  # waiters re-check the state; the error goes to this caller
            raise_in_context(exc, self.transfers.ctx(part, home, op))
        finally:
            part.moves.end(home)
            self._changed.notify()

    async def _finish_evict(
        self, part: Partition, tier: str, prev: CopyState, fut: asyncio.Future[None]
    ) -> None:
        """Write the claimed copy back if it is dirty, then delete it and return its budget."""
        try:
            if prev is DIRTY:
                # if a writer moved on meanwhile, a newer dirty copy lives elsewhere: ours is stale.
                # Every DIRTY copy holds the newest bytes (a write leaves one, a move from it
                # another), so while another one stays it carries the write-back: a gpu copy
                # gathered from a dirty cpu copy is then dropped, not written to NVMe as well
                others_dirty = any(st is DIRTY for t, st in part.copies().items() if t != tier)
                if (
                    part.state(part.home) is STALE
                    and not others_dirty
                    and part.version == part.moves.eviction_version(tier)
                ):
                    await self._writeback(part, src=tier, op="evict write-back")
                elif others_dirty:
                    self.stats.clean_drops += 1
                prev = VALID
            else:
                self.stats.clean_drops += 1
            await self.transfers.io(
                lambda: self.tiers[tier].backend.delete(part.name),
                self.transfers.ctx(part, tier, "evict"),
                retry=False,
            )
            part.end_eviction(tier, ABSENT)
            self.stats.evictions += 1
            self._unreserve(tier, part.nbytes)
        except BaseException as exc:  # noqa: BLE001 - restore the copy's state whatever stopped it, then re-raise in context
            part.end_eviction(tier, prev)
            raise_in_context(exc, self.transfers.ctx(part, tier, "evict"))
        finally:
            part.moves.end(tier)
            fut.set_result(None)
            self._changed.notify()

    def _wrote(self, part: Partition, tier: str) -> None:
        """`tier` now holds the only newest bytes: the rest go stale, freed when unpinned."""
        for t in part.wrote(tier):
            self._free_if_stale(part, t)

    def _free_if_stale(self, part: Partition, tier: str) -> None:
        if part.state(tier) is STALE and part.can_free(tier):
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            prev = part.claim_eviction(tier, fut)
            task = asyncio.get_running_loop().create_task(self._finish_evict(part, tier, prev, fut))
            task.add_done_callback(_log_failure)

    async def close_backends(self, timeout_s: float | None = None) -> None:
        """Close every tier's backend at once, each within `timeout_s` (default the manager's);
        see [Note: bounded close]."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        await close_all([(ts.name, ts.backend) for ts in self.tiers.values()], limit)


@dataclass(frozen=True)
class HomeClaim:
    """A partition's home copy held for the caller's own I/O ([Note: direct home I/O]); `checksum`
    is the digest recorded for the stored bytes (None when unverified)."""

    part: Partition
    write: bool
    checksum: int | None


def _fill(buf: torch.Tensor, init: torch.Tensor | None) -> None:
    if init is None:
        buf.zero_()
    else:
        buf.copy_(init)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("freeing a stale copy failed: %s", task.exception())
