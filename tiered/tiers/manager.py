"""`TierManager`: the public face of the tier layer.

Every method is safe to call from any thread. Methods that move bytes return a `TierFuture`
at once; the work runs on the manager's loop (see [Note: one loop, one bridge]) against the
state machine in `tiered.tiers.core` (see [Note: reserve before move], [Note: copy states]).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
import weakref
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import torch

from tiered.errors import StorageKeyError, TierTimeoutError
from tiered.storage.base import check_key
from tiered.tiers.context import _mark, crc32_of, with_context
from tiered.tiers.core import A, TierCore
from tiered.tiers.future import TierFuture
from tiered.tiers.loop import EventLoopThread
from tiered.tiers.partition import Partition, PinnedError
from tiered.tiers.policy import EvictionPolicy
from tiered.tiers.stats import ManagerStats, TierCounters
from tiered.tiers.tier import Tier
from tiered.tiers.trace import TraceRecorder

log = logging.getLogger(__name__)
T = TypeVar("T")


# [Note: managers left open at exit]
# A script that never calls close() must still exit promptly and cleanly. Python's own atexit
# handlers run too late for that: by then the interpreter has shut the thread pools down (no
# backend can close: swap files stay) and the loop's daemon thread can no longer take the GIL,
# so a close from a finaliser waited out its whole timeout (60 s). Managers still open are
# therefore closed from threading's exit hook, which runs before the pools shut down
# (registered after concurrent.futures', so called before it: the hooks run in reverse order).
_OPEN: weakref.WeakSet[TierManager] = weakref.WeakSet()
_hook_lock = threading.Lock()
_hook_installed = False


def _close_open_managers() -> None:
    left = list(_OPEN)
    if left:
        log.info("closing %d tier manager(s) left open at exit", len(left))
    for tm in left:
        try:
            tm.close()
        except Exception:  # noqa: BLE001 - exiting: close the rest regardless
            log.exception("closing a tier manager at exit failed")


def _close_at_exit(tm: TierManager) -> None:
    global _hook_installed
    _OPEN.add(tm)
    with _hook_lock:
        if not _hook_installed:
            register = getattr(threading, "_register_atexit", None)  # CPython >= 3.9
            (register or atexit.register)(_close_open_managers)
            _hook_installed = True


class TierManager:
    """Moves partitions between tiers (ordered fastest first) under hard byte budgets."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        timeout_s: float = 600.0,
        max_inflight_per_link: int = 4,
        record_trace: bool = False,
        io_threads: int = 8,
        verify: bool = False,
    ) -> None:
        tiers = list(tiers)
        if not tiers:
            raise ValueError("TierManager needs at least one tier, e.g. [Tier('cpu', backend)]")
        names = [t.name for t in tiers]
        for t in tiers:
            if not isinstance(t, Tier):
                raise TypeError(f"tiers must be tiered.tiers.Tier objects, got {type(t).__name__}")
            if names.count(t.name) > 1:
                raise ValueError(f"tier name {t.name!r} appears twice; every tier needs its own name")
        by_backend: dict[int, str] = {}
        for t in tiers:
            other = by_backend.setdefault(id(t.backend), t.name)
            if other != t.name:
                raise ValueError(
                    f"tiers {other!r} and {t.name!r} share one backend object; keys would collide - open a "
                    "separate backend for each tier"
                )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_inflight_per_link < 1:
            raise ValueError(f"max_inflight_per_link must be >= 1, got {max_inflight_per_link}")
        self.timeout_s = float(timeout_s)
        self._tiers = {t.name: t for t in tiers}
        self._loop = EventLoopThread(io_threads=io_threads)
        for t in tiers:  # every backend's blocking calls share the loop's one bounded bridge
            t.backend.use_bridge(self._loop.bridge)
        self._stats = ManagerStats(tiers={n: TierCounters() for n in names})
        self._trace = TraceRecorder(record_trace)
        self._core = TierCore(tiers, self._loop, timeout_s=self.timeout_s, max_inflight_per_link=max_inflight_per_link,
                              verify=verify, stats=self._stats, trace=self._trace)
        _close_at_exit(self)

    # ---- tiers -----------------------------------------------------------------------------
    @property
    def tier_names(self) -> list[str]:
        return list(self._tiers)

    def tier(self, name: str) -> Tier:
        try:
            return self._tiers[name]
        except KeyError:
            raise ValueError(f"unknown tier {name!r}; this manager has tiers {self.tier_names}") from None

    def budget_bytes(self, tier: str) -> int | None:
        self.tier(tier)
        return self._core.ts[tier].budget

    def resident_bytes(self, tier: str) -> int:
        """Bytes reserved in `tier` now (resident copies, moves in flight, home partitions)."""
        self.tier(tier)
        return self._core.ts[tier].used

    def peak_bytes(self, tier: str) -> int:
        self.tier(tier)
        return self._core.ts[tier].peak

    def set_eviction_policy(self, tier: str, policy: EvictionPolicy) -> None:
        self.tier(tier)
        if not callable(getattr(policy, "choose", None)):
            raise TypeError(f"eviction policy for tier {tier!r} must have choose(tier, candidates, need_bytes)")
        # a plain attribute swap: the loop reads it once per eviction round
        self._core.ts[tier].policy = policy

    # ---- partitions ------------------------------------------------------------------------
    def partitions(self) -> list[Partition]:
        return list(self._core.parts.values())

    def get(self, name: str) -> Partition:
        try:
            return self._core.parts[name]
        except KeyError:
            raise ValueError(f"no partition named {name!r} in this manager") from None

    def create(self, name: str, numel: int, dtype: torch.dtype, home: str,
               init: torch.Tensor | None = None) -> Partition:
        """Register a partition whose authoritative copy lives in `home`; blocks until written."""
        try:
            check_key(name)
        except StorageKeyError as exc:
            raise ValueError(f"partition name {name!r}: {exc}") from None
        self.tier(home)
        if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
            raise ValueError(f"partition {name!r}: numel must be a positive int, got {numel!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"partition {name!r}: dtype must be a torch.dtype, got {dtype!r}")
        if init is not None:
            if not isinstance(init, torch.Tensor):
                raise TypeError(f"partition {name!r}: init must be a tensor, got {type(init).__name__}")
            if init.numel() != numel or init.dtype != dtype:
                raise ValueError(
                    f"partition {name!r}: init has {init.numel()} elements of {init.dtype}, expected "
                    f"{numel} of {dtype} (flatten or cast it first)"
                )
            init = init.detach().reshape(-1)
        part = Partition(name, numel, dtype, home)
        self._run(self._create(part, init), f"create of partition {name!r} in tier {home!r}", home).result()
        return part

    async def _create(self, part: Partition, init: torch.Tensor | None) -> None:
        core, home = self._core, part.home
        if part.name in core.parts:
            raise ValueError(f"partition {part.name!r} already exists; names must be unique (drop it first)")
        ts = core.ts[home]
        err = core.never_fits(ts, part.nbytes, part, "create")
        if err is not None:
            raise _mark(err)
        core.parts[part.name] = part
        part._set(home, A.LOADING)
        part._busy[home] = asyncio.get_running_loop().create_future()
        reserved = False
        try:
            await core.reserve(home, part, "create")
            reserved = True
            ts.home_bytes += part.nbytes
            backend = ts.tier.backend
            if ts.memory_like:
                buf = backend.allocate(part.name, part.numel, part.dtype)
                await self._loop.run_blocking(_fill, buf, init)
            else:
                src = init.contiguous() if init is not None else torch.zeros(part.numel, dtype=part.dtype)
                await core.io(backend.write(part.name, src), core.ctx(part, home, "create"))
                if ts.persistent:
                    part._set_checksum(home, await self._loop.run_blocking(crc32_of, src))
            self._stats.tiers[home].writes += 1
            part._set(home, A.VALID)
        except BaseException as exc:
            part._set(home, A.ABSENT)
            core.parts.pop(part.name, None)
            if reserved:
                ts.home_bytes -= part.nbytes
                core.unreserve(home, part.nbytes)
            err2 = with_context(exc, core.ctx(part, home, "create"))
            if err2 is exc:
                raise
            raise err2 from exc
        finally:
            busy = part._busy.pop(home, None)
            if busy is not None and not busy.done():
                busy.set_result(None)
            core.notify()

    # ---- moves -----------------------------------------------------------------------------
    def fetch(self, part: Partition, tier: str) -> TierFuture[torch.Tensor]:
        """Make `part` resident in memory-like `tier` and pin it; the result is the resident tensor."""
        self._check(part, tier, "fetch", memory_like=True)
        if part.state(tier).readable and self._loop.started:
            # [Note: fetch fast path] already resident (by the snapshot): pin it with one plain
            # call on the loop instead of a task; a race that lost the copy falls through.
            hit = self._loop_call(self._pin_if_resident, part, tier)
            if hit is not None:
                return TierFuture.completed(hit, what=f"fetch of partition {part.name!r} to tier {tier!r}", tier=tier)
        return self._run(self._ensure(part, tier, pin=True, op="fetch"), f"fetch of partition {part.name!r} to tier {tier!r}", tier)

    def _pin_if_resident(self, part: Partition, tier: str) -> torch.Tensor | None:
        if self._core.parts.get(part.name) is not part or not part.state(tier).readable:
            return None
        part._pin(tier, +1)
        self._core.touch(part, tier)
        return self._core.view(part, tier)

    def prefetch(self, part: Partition, tier: str) -> TierFuture[None]:
        """Start making `part` resident in `tier`, without a pin (it may be evicted later)."""
        self._check(part, tier, "prefetch", memory_like=True)
        return self._run(self._prefetch(part, tier), f"prefetch of partition {part.name!r} to tier {tier!r}", tier)

    async def _prefetch(self, part: Partition, tier: str) -> None:
        await self._ensure(part, tier, pin=False, op="prefetch")

    async def _ensure(self, part: Partition, tier: str, *, pin: bool, op: str) -> torch.Tensor:
        core = self._core
        deadline = core.deadline()
        while True:
            self._alive(part)
            st = part.state(tier)
            if st.readable:
                if pin:
                    part._pin(tier, +1)
                core.touch(part, tier)
                return core.view(part, tier)
            busy = part._busy.get(tier)
            if busy is not None:
                remaining = deadline - asyncio.get_running_loop().time()
                try:
                    await asyncio.wait_for(asyncio.shield(busy), max(0.0, remaining))
                except TimeoutError:
                    raise _mark(TierTimeoutError(f"{op} of partition {part.name!r} to tier {tier!r}: a move in "
                                              f"flight there ran past {self.timeout_s} s")) from None
                continue
            if tier == part.home:  # home is stale: a faster copy is dirty; bring it home
                await core.writeback(part, op=f"{op} (home refresh)")
                continue
            await core.load(part, tier, op)

    def allocate(self, part: Partition, tier: str) -> TierFuture[torch.Tensor]:
        """A pinned resident buffer in `tier` the caller will fully overwrite: no read; it is dirty."""
        self._check(part, tier, "allocate", memory_like=True)
        return self._run(self._allocate(part, tier), f"allocate of partition {part.name!r} in tier {tier!r}", tier)

    async def _allocate(self, part: Partition, tier: str) -> torch.Tensor:
        core = self._core
        deadline = core.deadline()
        while (busy := part._busy.get(tier)) is not None:
            try:
                await asyncio.wait_for(asyncio.shield(busy), max(0.0, deadline - asyncio.get_running_loop().time()))
            except TimeoutError:
                raise _mark(TierTimeoutError(f"allocate of partition {part.name!r} in tier {tier!r}: a move in "
                                          f"flight there ran past {self.timeout_s} s")) from None
            except Exception:
                pass  # a failed load left the copy absent: allocate it ourselves
        self._alive(part)
        if part.state(tier) is A.ABSENT:
            fut = asyncio.get_running_loop().create_future()
            part._busy[tier] = fut
            part._set(tier, A.LOADING)
            try:
                await core.reserve(tier, part, "allocate")
                try:
                    core.ts[tier].tier.backend.allocate(part.name, part.numel, part.dtype)
                except BaseException:
                    core.unreserve(tier, part.nbytes)
                    raise
            except BaseException as exc:
                part._set(tier, A.ABSENT)
                err = with_context(exc, core.ctx(part, tier, "allocate"))
                if err is exc:
                    raise
                raise err from exc
            finally:
                part._busy.pop(tier, None)
                fut.set_result(None)
                core.notify()
        part._pin(tier, +1)
        core.touch(part, tier)
        core.invalidate_others(part, tier)
        return core.view(part, tier)

    def release(self, part: Partition, tier: str) -> None:
        """Unpin one fetch/allocate of `part` in `tier`."""
        self._check(part, tier, "release")
        self._loop_call(self._release, part, tier)

    def _release(self, part: Partition, tier: str) -> None:
        if part.pin_count(tier) <= 0:
            raise ValueError(
                f"release of partition {part.name!r} in tier {tier!r}: it is not pinned there "
                "(each release must match one fetch or allocate)"
            )
        part._pin(tier, -1)
        self._core.touch(part, tier)
        self._core.maybe_free_stale(part, tier)
        self._core.notify()

    def mark_dirty(self, part: Partition, tier: str) -> None:
        """The copy in `tier` was modified: it is now the only valid copy."""
        self._check(part, tier, "mark_dirty", memory_like=True)
        self._loop_call(self._mark_dirty, part, tier)

    def _mark_dirty(self, part: Partition, tier: str) -> None:
        self._alive(part)
        if not part.state(tier).readable:
            raise ValueError(
                f"mark_dirty of partition {part.name!r} in tier {tier!r}: no valid copy is resident there "
                f"(state {part.state(tier).value}); fetch or allocate it first"
            )
        self._core.invalidate_others(part, tier)
        self._core.notify()

    def evict(self, part: Partition, tier: str) -> TierFuture[None]:
        """Remove the copy in `tier` (written back first if dirty). Evicting from home is an error."""
        self._check(part, tier, "evict")
        if tier == part.home:
            raise ValueError(
                f"evict of partition {part.name!r} from tier {tier!r}: that is its home, where it lives until "
                "drop(); evict it from a faster tier instead"
            )
        return self._run(self._evict(part, tier), f"evict of partition {part.name!r} from tier {tier!r}", tier)

    async def _evict(self, part: Partition, tier: str) -> None:
        core = self._core
        deadline = core.deadline()
        while True:
            self._alive(part)
            if part.pin_count(tier):
                raise _mark(PinnedError(
                    f"evict of partition {part.name!r} from tier {tier!r}: it is pinned "
                    f"({part.pin_count(tier)} fetch/allocate not yet released); release() it first"
                ))
            busy = part._busy.get(tier)
            if busy is None and core.sources(part, tier) == 0:
                break
            await core.wait_change(deadline, lambda: f"evict of partition {part.name!r} from tier {tier!r}: "
                                                     f"a move on that copy ran past {self.timeout_s} s")
        if part.state(tier) is A.ABSENT:
            return
        await core.evict_copy(part, tier)

    def flush(self, part: Partition | None = None) -> TierFuture[None]:
        """Write dirty copies (of `part`, or of every partition) back to their home."""
        if part is not None:
            self._check(part, part.home, "flush")
        what = f"flush of partition {part.name!r}" if part is not None else "flush of all partitions"
        return self._run(self._flush(part), what, None)

    async def _flush(self, part: Partition | None) -> None:
        parts = [part] if part is not None else list(self._core.parts.values())
        results = await asyncio.gather(
            *[self._core.writeback(p, op="flush") for p in parts if p.state(p.home) is A.STALE],
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if len(errors) > 1:
                log.error("flush: %d partitions failed to write back; first: %s", len(errors), errors[0])
            raise errors[0]

    def drop(self, part: Partition) -> TierFuture[None]:
        """Delete `part` from every tier (its home too) and forget it."""
        self._check(part, part.home, "drop")
        return self._run(self._drop(part), f"drop of partition {part.name!r}", None)

    async def _drop(self, part: Partition) -> None:
        core = self._core
        deadline = core.deadline()
        while part._busy or any(core.sources(part, t) for t in core.order):
            await core.wait_change(deadline, lambda: f"drop of partition {part.name!r}: moves still in flight "
                                                     f"after {self.timeout_s} s")
        self._alive(part)
        pinned = {t: n for t, n in part.pins().items() if n}
        if pinned:
            raise _mark(PinnedError(f"drop of partition {part.name!r}: still pinned in {pinned}; release() first"))
        core.parts.pop(part.name, None)
        errors = []
        for t, st in list(part.copies().items()):
            if st is A.ABSENT:
                continue
            try:
                await core.io(core.ts[t].tier.backend.delete(part.name), core.ctx(part, t, "drop"))
            except Exception as exc:  # keep going: the budget must come back even if a file lingers
                errors.append(with_context(exc, core.ctx(part, t, "drop")))
            part._set(t, A.ABSENT)
            core.unreserve(t, part.nbytes)
        core.ts[part.home].home_bytes -= part.nbytes
        core.notify()
        if errors:
            raise errors[0]

    # ---- observability ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """JSON-able counters: per tier, per link, stalls, evictions, write-backs."""
        extra = {
            n: {"budget_bytes": ts.budget, "resident_bytes": ts.used, "peak_bytes": ts.peak}
            for n, ts in self._core.ts.items()
        }
        return self._stats.to_json(extra)

    def trace_events(self) -> list[dict[str, Any]]:
        return self._trace.events()

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the recorded moves as Chrome-trace JSON (needs record_trace=True)."""
        if not self._trace.enabled:
            raise ValueError("write_trace: this manager was created with record_trace=False; pass record_trace=True")
        self._trace.write(path)

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self, *, close_backends: bool = True) -> None:
        """Cancel work in flight, close the tiers' backends (unless told not to) and stop the
        loop thread. Flushes nothing: call ``flush().result()`` first to keep dirty bytes.
        Idempotent."""
        if self._loop.closed:
            return
        _OPEN.discard(self)
        if close_backends:
            try:
                self._loop.loop()  # backends close on the loop, even if nothing else ever ran
            except Exception:  # already closing in another thread
                pass
        self._loop.close(timeout_s=min(self.timeout_s, 60.0), final=self._close_backends if close_backends else None)

    async def _close_backends(self) -> None:
        for t in self._tiers.values():
            try:
                await t.backend.close()
            except Exception:  # one bad backend must not keep the others open
                log.exception("closing backend %r of tier %r failed", t.backend.name, t.name)

    def __enter__(self) -> TierManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TierManager(tiers={self.tier_names}, partitions={len(self._core.parts)})"

    # ---- plumbing --------------------------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, T], what: str, tier: str | None) -> TierFuture[T]:
        fut = self._loop.submit(coro)
        # a little past the loop's own timeouts, so their more specific message arrives first
        grace = self.timeout_s + min(5.0, 0.5 + 0.1 * self.timeout_s)
        return TierFuture(fut, what=what, tier=tier, default_timeout_s=grace, on_stall=self._stats.add_stall)

    def _loop_call(self, fn: Any, *args: Any) -> Any:
        return self._loop.call(fn, *args, timeout_s=self.timeout_s)

    def _check(self, part: Partition, tier: str, op: str, *, memory_like: bool = False) -> None:
        if not isinstance(part, Partition):
            raise TypeError(f"{op}: expected a Partition from TierManager.create, got {type(part).__name__}")
        self.tier(tier)
        if memory_like and not self._core.ts[tier].memory_like:
            raise ValueError(
                f"{op} of partition {part.name!r} into tier {tier!r}: backend "
                f"{self._tiers[tier].backend.name!r} is not memory-like (it has no resident tensors); "
                "use a memory-like tier such as 'gpu' or 'cpu'"
            )
        self._alive(part)

    def _alive(self, part: Partition) -> None:
        if self._core.parts.get(part.name) is not part:
            raise ValueError(f"partition {part.name!r} is not managed here (it was dropped, or belongs to "
                             "another manager)")


def _fill(buf: torch.Tensor, init: torch.Tensor | None) -> None:
    if init is None:
        buf.zero_()
    else:
        buf.copy_(init)
