"""Partitions: the one owner object of a flat buffer's placement across tiers.

[Note: copy states]
A partition has at most one copy per tier, each in one `CopyState`. The home copy exists for the
partition's whole life (its bytes are counted against the home budget from `create` to `drop`);
copies in other tiers come and go. The invariant the manager keeps:

* the home copy is VALID, or it is STALE and at least one other copy is DIRTY;
* a copy is DIRTY exactly when it holds the newest bytes and home does not, so evicting or
  flushing it must write it back first; a VALID copy can be dropped for free.

The partition is the one owner of all of this: copy states, pins, checksums, its version
([Note: versions] in `tiered.tiers.state_machine`), last use per tier, and the moves in flight on
it (`MovesInFlight`). Each changes only through the small transition methods below, called only by
the `TierStateMachine` on the manager's loop thread (see [Note: one loop, one bridge]); the public
mappings are replaced, never mutated in place, so another thread reading `valid_in()` or `pins()`
always sees one consistent snapshot without a lock.

[Note: kept copies]
A tier is a cache of the one below: a partition may be *kept* in a faster tier than its home
(`TierManager.keep`), which means its copy there, once made, stays across uses instead of being
evicted when its user is done (`TierManager.settle` evicts a copy only where it is not kept). A
kept copy is an ordinary copy: dirty when it holds bytes its home does not (it is then written
home only when it is evicted, a checkpoint reads it where it is), clean when home has them too
(then never written again). Kept or not changes nothing about which bytes are the newest, so
results are bitwise those of a run without it. Under budget pressure the manager evicts kept
copies last, after every copy that is not kept ([Note: reserve before move]); who keeps what,
and why, is the engine's residency plan ([Note: residency] in tiered/planning/residency.py).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping
from types import MappingProxyType

import torch

from tiered.errors import PinnedError  # noqa: F401 - re-exported for tiered.tiers


class CopyState(enum.Enum):
    """Where one tier's copy of a partition stands, and who holds its bytes."""

    ABSENT = "absent"
    """The tier holds no bytes of this partition and no budget is reserved for it."""
    LOADING = "loading"
    """Budget is reserved and the tier's backend holds a buffer being filled by a move in
    flight; its bytes are not readable yet."""
    VALID = "valid"
    """The tier's backend holds bytes equal to the newest value; dropping them costs no write."""
    DIRTY = "dirty"
    """The tier's backend holds the newest bytes and home does not: they must be written back
    to home before the copy is dropped."""
    STALE = "stale"
    """The tier's backend holds out-of-date bytes: the home copy while a faster copy is dirty,
    or a pinned copy that another tier's write invalidated (freed when unpinned)."""
    EVICTING = "evicting"
    """The tier's backend still holds the bytes while they are written back and deleted; the
    budget is returned when the delete completes."""

    @property
    def readable(self) -> bool:
        """The copy's bytes are the newest value and may be used as a move's source."""
        return self in (CopyState.VALID, CopyState.DIRTY)

    @property
    def resident(self) -> bool:
        """The tier's backend holds (or is filling) bytes for this partition."""
        return self is not CopyState.ABSENT


class MovesInFlight:
    """The moves on one partition's copies right now: who is busy where, who reads which copy.

    Owned by its `Partition`; written by the state machine only (loop thread). Per tier: the
    asyncio future of the move, write-back or eviction in flight there (one at a time), the
    number of moves reading that copy (so no eviction takes it away), and for an eviction the
    partition's version when it was claimed.
    """

    __slots__ = ("_busy", "_readers", "_evict_version")

    def __init__(self) -> None:
        self._busy: dict[str, asyncio.Future[None]] = {}
        self._readers: dict[str, int] = {}
        self._evict_version: dict[str, int] = {}

    def busy(self, tier: str) -> asyncio.Future[None] | None:
        """The future of the move in flight in `tier`, if any (waiters shield and await it)."""
        return self._busy.get(tier)

    def any(self) -> bool:
        """Some move is in flight on, or reading, one of the copies."""
        return bool(self._busy) or bool(self._readers)

    def readers(self, tier: str) -> int:
        return self._readers.get(tier, 0)

    def eviction_version(self, tier: str) -> int | None:
        return self._evict_version.get(tier)

    def claim(self, tier: str, fut: asyncio.Future[None], *, evicting_version: int | None = None) -> None:
        self._busy[tier] = fut
        if evicting_version is not None:
            self._evict_version[tier] = evicting_version

    def end(self, tier: str) -> asyncio.Future[None] | None:
        """Forget the move in `tier` (idempotent); its future, for the caller to complete."""
        self._evict_version.pop(tier, None)
        return self._busy.pop(tier, None)

    def add_reader(self, tier: str) -> None:
        self._readers[tier] = self._readers.get(tier, 0) + 1

    def drop_reader(self, tier: str) -> None:
        n = self._readers[tier] - 1
        if n:
            self._readers[tier] = n
        else:
            del self._readers[tier]


class Partition:
    """One named, contiguous, flat buffer of one dtype; created only by `TierManager.create`.

    Read-only from the outside: the state machine on the manager's loop thread owns every
    transition. See [Note: copy states].
    """

    __slots__ = (
        "_copies",
        "_pins",
        "_checksums",
        "_last_use",
        "_version",
        "_kept",
        "moves",
        "name",
        "numel",
        "dtype",
        "nbytes",
        "home",
        "__weakref__",
    )

    def __init__(self, name: str, numel: int, dtype: torch.dtype, home: str) -> None:
        self.name = name
        self.numel = int(numel)
        self.dtype = dtype
        self.nbytes = self.numel * torch.empty(0, dtype=dtype).element_size()
        self.home = home
        self._copies: Mapping[str, CopyState] = MappingProxyType({})
        self._pins: Mapping[str, int] = MappingProxyType({})
        self._checksums: Mapping[str, int] = MappingProxyType({})
        self._last_use: dict[str, int] = {}
        self._version = 0
        self._kept: frozenset[str] = frozenset()
        self.moves = MovesInFlight()
        """The moves in flight on this partition's copies (state machine only)."""

    # ---- read-only views (any thread) ------------------------------------------------------
    def state(self, tier: str) -> CopyState:
        return self._copies.get(tier, CopyState.ABSENT)

    def copies(self) -> Mapping[str, CopyState]:
        """A snapshot of every tier's copy state (absent tiers omitted)."""
        return self._copies

    def valid_in(self) -> frozenset[str]:
        """Tiers whose copy holds the newest bytes (VALID or DIRTY)."""
        return frozenset(t for t, s in self._copies.items() if s.readable)

    def dirty_in(self) -> frozenset[str]:
        return frozenset(t for t, s in self._copies.items() if s is CopyState.DIRTY)

    def is_resident(self, tier: str) -> bool:
        """The tier holds the newest bytes of this partition right now."""
        return self.state(tier).readable

    def pin_count(self, tier: str) -> int:
        return self._pins.get(tier, 0)

    def pins(self) -> Mapping[str, int]:
        return self._pins

    def checksum(self, tier: str) -> int | None:
        """crc32 of the bytes last written to persistent `tier`, if any."""
        return self._checksums.get(tier)

    @property
    def version(self) -> int:
        """Bumped by every write into the partition (see [Note: versions])."""
        return self._version

    def kept_in(self) -> frozenset[str]:
        """The tiers whose copy stays across uses ([Note: kept copies])."""
        return self._kept

    def is_kept(self, tier: str) -> bool:
        return tier in self._kept

    def last_use(self, tier: str) -> int:
        """The manager's tick of the last fetch, prefetch, allocate or release in `tier`; -1 if none."""
        return self._last_use.get(tier, -1)

    def can_free(self, tier: str) -> bool:
        """A non-home copy nobody pins, moves or reads: an eviction may claim it now."""
        return (
            tier != self.home
            and self.pin_count(tier) == 0
            and self.moves.busy(tier) is None
            and self.moves.readers(tier) == 0
        )

    def __repr__(self) -> str:
        states = ", ".join(f"{t}={s.value}" for t, s in self._copies.items())
        return (
            f"Partition({self.name!r}, numel={self.numel}, dtype={self.dtype}, home={self.home!r}, {states})"
        )

    # ---- transitions (state machine, loop thread only) -------------------------------------
    def pin(self, tier: str, delta: int, tick: int) -> int:
        """Add `delta` (+1 fetch/allocate, -1 release) to the pins in `tier`, note the use."""
        pins = dict(self._pins)
        n = pins.get(tier, 0) + delta
        if n < 0:
            raise AssertionError(f"partition {self.name!r}: pin count in tier {tier!r} would go negative")
        if n:
            pins[tier] = n
        else:
            pins.pop(tier, None)
        self._pins = MappingProxyType(pins)
        self.touch(tier, tick)
        return n

    def set_kept(self, tier: str, kept: bool) -> None:
        """Keep (or stop keeping) this partition's copy in `tier` across uses ([Note: kept copies])."""
        self._kept = (self._kept | {tier}) if kept else (self._kept - {tier})

    def touch(self, tier: str, tick: int) -> None:
        self._last_use[tier] = tick

    def set_checksum(self, tier: str, crc: int | None) -> None:
        sums = dict(self._checksums)
        if crc is None:
            sums.pop(tier, None)
        else:
            sums[tier] = crc
        self._checksums = MappingProxyType(sums)

    def start_load(self, tier: str, fut: asyncio.Future[None]) -> bool:
        """A move into `tier` begins (LOADING, busy); True if it reuses a stale buffer there."""
        reused = self.state(tier) is CopyState.STALE
        self.moves.claim(tier, fut)
        self._set(tier, CopyState.LOADING)
        return reused

    def end_load(self, tier: str, version: int) -> None:
        """The move that started at `version` filled `tier`: the newest bytes, unless a writer
        moved on meanwhile (then STALE, and the caller retries; [Note: versions])."""
        if self._version != version:
            self._set(tier, CopyState.STALE)
        else:
            self._set(tier, CopyState.DIRTY if self.state(self.home) is CopyState.STALE else CopyState.VALID)

    def fail_load(self, tier: str, reused: bool) -> None:
        """A move into `tier` failed: a reused buffer stays (stale), a fresh one is gone."""
        self._set(tier, CopyState.STALE if reused else CopyState.ABSENT)

    def claim_eviction(self, tier: str, fut: asyncio.Future[None]) -> CopyState:
        """Claim an idle, unpinned, non-home copy for eviction; the state it had."""
        prev = self.state(tier)
        assert prev in (CopyState.VALID, CopyState.DIRTY, CopyState.STALE) and self.can_free(tier), (
            self,
            tier,
        )
        self.moves.claim(tier, fut, evicting_version=self._version)
        self._set(tier, CopyState.EVICTING)
        return prev

    def end_eviction(self, tier: str, state: CopyState) -> None:
        """The eviction in `tier` ended: ABSENT when the delete completed, else back to `state`."""
        self._set(tier, state)

    def written_back(self, version: int) -> None:
        """A write-back started at `version` landed in home: every copy is clean, unless a
        writer moved on meanwhile ([Note: versions])."""
        if self._version != version:
            return
        self._set(self.home, CopyState.VALID)
        for t, st in self._copies.items():
            if st is CopyState.DIRTY:
                self._set(t, CopyState.VALID)

    def wrote(self, tier: str) -> list[str]:
        """`tier` now holds the only newest bytes (allocate, mark_dirty): bump the version, the
        other copies go stale. Returns the non-home tiers made stale (to free when unpinned);
        LOADING / EVICTING copies notice the version change themselves."""
        self._version += 1
        stale = []
        for t, st in self._copies.items():
            if t == tier or st is CopyState.ABSENT:
                continue
            if t == self.home:
                self._set(t, CopyState.STALE)
                self.set_checksum(t, None)
            elif st in (CopyState.VALID, CopyState.DIRTY):
                self._set(t, CopyState.STALE)
                stale.append(t)
        self._set(tier, CopyState.VALID if tier == self.home else CopyState.DIRTY)
        return stale

    def _set(self, tier: str, state: CopyState) -> None:
        copies = dict(self._copies)
        if state is CopyState.ABSENT:
            copies.pop(tier, None)
        else:
            copies[tier] = state
        self._copies = MappingProxyType(copies)
