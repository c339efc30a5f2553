"""`TierManager`: the public face of the tier layer, a thread-safe facade.

Every method is safe to call from any thread. It checks its arguments here, in the caller's
thread, then hands the operation, written once as a coroutine or a small function of the
`TierStateMachine`, to the manager's loop (see [Note: one loop, one bridge]): methods that move
bytes return a `TierFuture` at once, the others wait for their plain call on the loop. The
facade writes no state of its own ([Note: reserve before move], [Note: copy states]).

[Note: discarded copies]
`discard` is `evict` for bytes nobody will read again: a dirty copy is freed without its
write-back, and (when no other copy is dirty) the home's stored bytes become the partition's
value again, unverified by a checksum (none was recorded for them as the newest). Its one user is
the optimizer step, for a gradient it consumed from memory ([Note: gradient consumed from memory]
in tiered/optim/group.py): the gradient is dead after the step (the next backward overwrites
it), so writing it to a slower home and never reading it back would be bytes for nothing. A copy
that was clean anyway is dropped as by `evict`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import torch

from tiered.errors import StorageKeyError
from tiered.storage.base import check_key
from tiered.tiers.budget import TierBudget
from tiered.tiers.future import TierFuture
from tiered.tiers.io_policy import IOPolicy
from tiered.tiers.loop import EventLoopThread
from tiered.tiers.partition import CopyState, Partition
from tiered.tiers.policy import EvictionPolicy
from tiered.tiers.state_machine import HomeClaim, TierStateMachine, check_managed
from tiered.tiers.stats import ManagerStats, TierCounters
from tiered.tiers.tier import Tier
from tiered.tiers.trace import TraceRecorder
from tiered.tiers.transfer import Transfers
from tiered.tiers.waiting import request_deadline

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
        except Exception:
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
        verify: bool = True,
        io_policy: IOPolicy | None = None,
    ) -> None:
        """`verify`: checksum every write to a non-memory tier and check it on every read back
        ([Note: partition checksums]); `io_policy`: the per-call timeouts and retries
        ([Note: byte-scaled I/O timeouts]), by default `IOPolicy(timeout_s=timeout_s)`."""
        tiers = _checked_tiers(tiers)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_inflight_per_link < 1:
            raise ValueError(f"max_inflight_per_link must be >= 1, got {max_inflight_per_link}")
        self.timeout_s = float(timeout_s)
        self._tiers = {t.name: t for t in tiers}
        # every backend's blocking calls share the loop's one bounded bridge, widened by the
        # share each backend bounds itself to, so its calls never starve the manager's copies
        shares = sum(max(0, int(getattr(t.backend, "io_concurrency", 0))) for t in tiers)
        self._loop = EventLoopThread(io_threads=io_threads, backend_threads=shares)
        for t in tiers:
            t.backend.use_bridge(self._loop.bridge)
        self._stats = ManagerStats(tiers={t.name: TierCounters() for t in tiers})
        self._trace = TraceRecorder(record_trace)
        budgets = {t.name: TierBudget.of(t) for t in tiers}
        transfers = Transfers(
            budgets,
            self._loop,
            timeout_s=self.timeout_s,
            max_inflight_per_link=max_inflight_per_link,
            verify=verify,
            stats=self._stats,
            trace=self._trace,
            policy=io_policy if io_policy is not None else IOPolicy(timeout_s=self.timeout_s),
        )
        self._machine = TierStateMachine(budgets, transfers, self.timeout_s)
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
        return self._machine.tiers[tier].budget

    def resident_bytes(self, tier: str) -> int:
        """Bytes reserved in `tier` now (resident copies, moves in flight, home partitions)."""
        self.tier(tier)
        return self._machine.tiers[tier].used

    def clean_room_bytes(self, tier: str) -> int | None:
        """Bytes a request could reserve in `tier` now without writing anything home: the free
        budget plus the copies an eviction may drop for free (unpinned, not dirty); None for an
        unbounded tier. The kept gradients' admission asks it ([Note: backward waits instead of
        parking] in tiered/optim/kept_grads.py)."""
        self.tier(tier)
        return self._loop_call(_clean_room, self._machine, tier)

    def peak_bytes(self, tier: str) -> int:
        self.tier(tier)
        return self._machine.tiers[tier].peak

    def set_eviction_policy(self, tier: str, policy: EvictionPolicy) -> None:
        self.tier(tier)
        if not callable(getattr(policy, "choose", None)):
            raise TypeError(
                f"eviction policy for tier {tier!r} must have choose(tier, candidates, need_bytes)"
            )
        self._machine.set_policy(tier, policy)

    # ---- partitions ------------------------------------------------------------------------
    def partitions(self) -> list[Partition]:
        return list(self._machine.parts.values())

    def get(self, name: str) -> Partition:
        try:
            return self._machine.parts[name]
        except KeyError:
            raise ValueError(f"no partition named {name!r} in this manager") from None

    def create(
        self, name: str, numel: int, dtype: torch.dtype, home: str, init: torch.Tensor | None = None
    ) -> Partition:
        """Register a partition whose authoritative copy lives in `home`; blocks until written."""
        _check_name(name)
        self.tier(home)
        init = _checked_init(name, numel, dtype, init)
        part = Partition(name, numel, dtype, home)
        self._run(
            self._machine.create(part, init), f"create of partition {name!r} in tier {home!r}", home
        ).result()
        return part

    # ---- moves (each one call into the state machine) --------------------------------------
    def fetch(self, part: Partition, tier: str) -> TierFuture[torch.Tensor]:
        """Make `part` resident in memory-like `tier` and pin it; the result is the resident tensor."""
        self._check(part, tier, "fetch", memory_like=True)
        what = f"fetch of partition {part.name!r} to tier {tier!r}"
        if part.state(tier).readable and self._loop.started:
            # [Note: fetch fast path] already resident (by the snapshot): pin it with one plain
            # call on the loop instead of a task; a race that lost the copy falls through.
            hit = self._loop_call(self._machine.pin_if_resident, part, tier)
            if hit is not None:
                return TierFuture.completed(hit, what=what, tier=tier)
        return self._run(self._machine.ensure(part, tier, pin=True, op="fetch"), what, tier)

    def prefetch(self, part: Partition, tier: str) -> TierFuture[None]:
        """Start making `part` resident in `tier`, without a pin (it may be evicted later)."""
        self._check(part, tier, "prefetch", memory_like=True)
        return self._run(
            _discard(self._machine.ensure(part, tier, pin=False, op="prefetch")),
            f"prefetch of partition {part.name!r} to tier {tier!r}",
            tier,
        )

    def allocate(self, part: Partition, tier: str) -> TierFuture[torch.Tensor]:
        """A pinned resident buffer in `tier` the caller will fully overwrite: no read; it is dirty."""
        self._check(part, tier, "allocate", memory_like=True)
        return self._run(
            self._machine.allocate(part, tier), f"allocate of partition {part.name!r} in tier {tier!r}", tier
        )

    def release(self, part: Partition, tier: str) -> None:
        """Unpin one fetch/allocate of `part` in `tier`."""
        self._check(part, tier, "release")
        self._loop_call(self._machine.release, part, tier)

    def mark_dirty(self, part: Partition, tier: str) -> None:
        """The copy in `tier` was modified: it is now the only valid copy."""
        self._check(part, tier, "mark_dirty", memory_like=True)
        self._loop_call(self._machine.mark_dirty, part, tier)

    def evict(self, part: Partition, tier: str) -> TierFuture[None]:
        """Remove the copy in `tier` (written back first if dirty). Evicting from home is an error."""
        self._check(part, tier, "evict")
        if tier == part.home:
            raise ValueError(
                f"evict of partition {part.name!r} from tier {tier!r}: that is its home, where it lives until "
                "drop(); evict it from a faster tier instead"
            )
        return self._run(
            self._machine.evict(part, tier), f"evict of partition {part.name!r} from tier {tier!r}", tier
        )

    def discard(self, part: Partition, tier: str) -> TierFuture[None]:
        """Remove `part`'s copy in `tier` without writing it back, even when it is the dirty
        newest one: the caller declares its bytes dead. See [Note: discarded copies]."""
        self._check(part, tier, "discard")
        if tier == part.home:
            raise ValueError(
                f"discard of partition {part.name!r} in tier {tier!r}: that is its home; discard a copy "
                "in a faster tier"
            )
        return self._run(
            self._machine.evict(part, tier, discard=True),
            f"discard of partition {part.name!r} from tier {tier!r}",
            tier,
        )

    def keep(self, part: Partition, tier: str, kept: bool = True) -> None:
        """Keep `part`'s copy in memory-like `tier` across uses (False: no longer): `settle` then
        leaves it there, and the tier evicts it only after every copy it does not keep. See
        [Note: kept copies] in tiered/tiers/partition.py."""
        self._check(part, tier, "keep", memory_like=True)
        if tier == part.home:
            raise ValueError(
                f"keep of partition {part.name!r} in tier {tier!r}: that is its home, where it always "
                "lives; keep it in a faster tier"
            )
        self._loop_call(self._machine.keep, part, tier, kept)

    def settle(self, part: Partition, tier: str) -> TierFuture[None]:
        """The caller is done with `part`'s copy in `tier`: it stays there if `part` is kept there
        (`keep`), else it is evicted (written home first if dirty), as `evict`."""
        self._check(part, tier, "settle")
        if tier == part.home:
            raise ValueError(
                f"settle of partition {part.name!r} in tier {tier!r}: that is its home; settle a copy in "
                "a faster tier"
            )
        return self._run(
            self._machine.settle(part, tier), f"settle of partition {part.name!r} in tier {tier!r}", tier
        )

    def kept_bytes(self, tier: str) -> int:
        """Bytes of the partitions kept in `tier` ([Note: kept copies]), resident there or not."""
        self.tier(tier)
        return sum(p.nbytes for p in self._machine.parts.values() if p.is_kept(tier))

    def flush(self, part: Partition | None = None) -> TierFuture[None]:
        """Write dirty copies (of `part`, or of every partition) back to their home."""
        if part is not None:
            self._check(part, part.home, "flush")
        what = f"flush of partition {part.name!r}" if part is not None else "flush of all partitions"
        return self._run(self._machine.flush(part), what, None)

    def drop(self, part: Partition) -> TierFuture[None]:
        """Delete `part` from every tier (its home too) and forget it."""
        self._check(part, part.home, "drop")
        return self._run(self._machine.drop(part), f"drop of partition {part.name!r}", None)

    # ---- direct home I/O: see [Note: direct home I/O] in tiered.tiers.state_machine ---------
    def claim_home(self, part: Partition, *, write: bool) -> HomeClaim | None:
        """Hold `part`'s home copy for the caller's own reads (or a replacement, `write`) of its
        stored object; None for a read while a faster copy holds newer bytes. Pair with
        `release_home` or (a write) `commit_home`."""
        self._check(part, part.home, "claim_home")
        what = f"claim of partition {part.name!r}'s home {part.home!r}"
        return self._run(self._machine.claim_home(part, write=write), what, part.home).result()

    def commit_home(self, claim: HomeClaim, source: str | os.PathLike[str], checksum: int | None) -> None:
        """Make the complete file `source` (beside ``local_file(name).path`` of the home's
        backend) `claim`'s partition's stored object and newest value, with digest `checksum`
        (`StorageBackend.adopt_file`); releases the claim either way."""
        what = f"commit of partition {claim.part.name!r}'s home {claim.part.home!r}"
        self._run(
            self._machine.commit_home(claim, os.fspath(source), checksum), what, claim.part.home
        ).result()

    def release_home(self, claim: HomeClaim) -> None:
        self._loop_call(self._machine.release_home, claim)

    # ---- observability ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """JSON-able counters: per tier, per link, stalls, evictions, write-backs."""
        parts = list(self._machine.parts.values())
        extra = {
            n: {
                "budget_bytes": ts.budget,
                "resident_bytes": ts.used,
                "peak_bytes": ts.peak,
                # [Note: kept copies]: what stays there across uses, and how much of it is there now
                "kept_bytes": sum(p.nbytes for p in parts if p.is_kept(n)),
                "kept_resident_bytes": sum(p.nbytes for p in parts if p.is_kept(n) and p.is_resident(n)),
            }
            for n, ts in self._machine.tiers.items()
        }
        return self._stats.to_json(extra)

    def trace_events(self) -> list[dict[str, Any]]:
        return self._trace.events()

    @property
    def tracing(self) -> bool:
        """Whether moves (and spans) are recorded: record_trace=True (tiered.trace_path)."""
        return self._trace.enabled

    def record_span(self, name: str, track: str, start_s: float, end_s: float, **args: Any) -> None:
        """Add a span of other work (compute, the Adam of a group) to the moves' trace, on track
        `track`, from `time.perf_counter()` readings; a no-op unless tracing."""
        self._trace.add(name, track, start_s, end_s, **args)

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the recorded moves as Chrome-trace JSON (needs record_trace=True)."""
        if not self._trace.enabled:
            raise ValueError(
                "write_trace: this manager was created with record_trace=False; pass record_trace=True"
            )
        self._trace.write(path)

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self, *, close_backends: bool = True, timeout_s: float | None = None) -> None:
        """Cancel work in flight, close the tiers' backends (unless told not to) and stop the
        loop thread. Flushes nothing: call ``flush().result()`` first to keep dirty bytes.
        Idempotent. Bounded by ``timeout_s`` (the manager's own unless given a shorter one): a
        backend still closing then is a TierTimeoutError naming it and its tier, the others
        closed ([Note: bounded close])."""
        if self._loop.closed:
            return
        _OPEN.discard(self)
        if close_backends:
            try:
                self._loop.loop()  # backends close on the loop, even if nothing else ever ran
            except Exception:  # noqa: BLE001 - already closing in another thread
                pass
        self._loop.close(
            timeout_s=self.timeout_s
            if timeout_s is None
            else min(timeout_s, self.timeout_s),  # [Note: bounded close]
            final=self._machine.close_backends if close_backends else None,
        )

    def __enter__(self) -> TierManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TierManager(tiers={self.tier_names}, partitions={len(self._machine.parts)})"

    # ---- plumbing --------------------------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, T], what: str, tier: str | None) -> TierFuture[T]:
        fut = self._loop.submit(request_deadline(coro, self.timeout_s))  # [Note: one deadline per request]
        # a little past the loop's own deadline, so its more specific message arrives first, and
        # within 10% of timeout_s when the loop itself is stuck
        grace = 1.05 * self.timeout_s + 0.1
        return TierFuture(fut, what=what, tier=tier, default_timeout_s=grace, on_stall=self._stats.add_stall)

    def _loop_call(self, fn: Callable[..., T], *args: Any) -> T:
        return self._loop.call(fn, *args, timeout_s=self.timeout_s)

    def _check(self, part: Partition, tier: str, op: str, *, memory_like: bool = False) -> None:
        if not isinstance(part, Partition):
            raise TypeError(f"{op}: expected a Partition from TierManager.create, got {type(part).__name__}")
        self.tier(tier)
        if memory_like and not self._machine.tiers[tier].memory_like:
            raise ValueError(
                f"{op} of partition {part.name!r} into tier {tier!r}: backend "
                f"{self._tiers[tier].backend.name!r} is not memory-like (it has no resident tensors); "
                "use a memory-like tier such as 'gpu' or 'cpu'"
            )
        check_managed(self._machine.parts, part)


def _checked_tiers(tiers: Sequence[Tier]) -> list[Tier]:
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
    return tiers


def _clean_room(machine: TierStateMachine, tier: str) -> int | None:
    ts = machine.tiers[tier]
    if ts.budget is None:
        return None
    clean = (CopyState.VALID, CopyState.STALE)
    return (
        ts.budget
        - ts.used
        + sum(p.nbytes for p in machine.parts.values() if p.state(tier) in clean and p.can_free(tier))
    )


def _check_name(name: str) -> None:
    try:
        check_key(name)
    except StorageKeyError as exc:
        raise ValueError(f"partition name {name!r}: {exc}") from None


def _checked_init(
    name: str, numel: int, dtype: torch.dtype, init: torch.Tensor | None
) -> torch.Tensor | None:
    """`create`'s arguments checked in the caller's thread; the flat init tensor."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
        raise ValueError(f"partition {name!r}: numel must be a positive int, got {numel!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"partition {name!r}: dtype must be a torch.dtype, got {dtype!r}")
    if init is None:
        return None
    if not isinstance(init, torch.Tensor):
        raise TypeError(f"partition {name!r}: init must be a tensor, got {type(init).__name__}")
    if init.numel() != numel or init.dtype != dtype:
        raise ValueError(
            f"partition {name!r}: init has {init.numel()} elements of {init.dtype}, expected "
            f"{numel} of {dtype} (flatten or cast it first)"
        )
    return init.detach().reshape(-1)


async def _discard(aw: Awaitable[Any]) -> None:
    await aw
