"""Partitions: the one owner object of a flat buffer's placement across tiers.

[Note: copy states]
A partition has at most one copy per tier, each in one `CopyState`. The home copy exists for the
partition's whole life (its bytes are counted against the home budget from `create` to `drop`);
copies in other tiers come and go. The invariant the manager keeps:

* the home copy is VALID, or it is STALE and at least one other copy is DIRTY;
* a copy is DIRTY exactly when it holds the newest bytes and home does not, so evicting or
  flushing it must write it back first; a VALID copy can be dropped for free.

State is written only on the manager's loop thread (see [Note: one loop, one bridge]); the
mappings are replaced, never mutated in place, so another thread reading `valid_in()` or
`pins()` always sees one consistent snapshot without a lock.
"""

from __future__ import annotations

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


class Partition:
    """One named, contiguous, flat buffer of one dtype; created only by `TierManager.create`.

    Read-only from the outside: the manager's loop thread owns every transition.
    """

    __slots__ = ("_copies", "_pins", "_checksums", "_last_use", "_busy", "name", "numel", "dtype", "nbytes",
                 "home", "__weakref__")

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
        # tier -> the asyncio future of the move or eviction in flight there (loop thread only)
        self._busy: dict[str, object] = {}

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

    def __repr__(self) -> str:
        states = ", ".join(f"{t}={s.value}" for t, s in self._copies.items())
        return f"Partition({self.name!r}, numel={self.numel}, dtype={self.dtype}, home={self.home!r}, {states})"

    # ---- transitions (loop thread only; idempotent) ----------------------------------------
    def _set(self, tier: str, state: CopyState) -> None:
        copies = dict(self._copies)
        if state is CopyState.ABSENT:
            copies.pop(tier, None)
        else:
            copies[tier] = state
        self._copies = MappingProxyType(copies)

    def _pin(self, tier: str, delta: int) -> int:
        pins = dict(self._pins)
        n = pins.get(tier, 0) + delta
        if n < 0:
            raise AssertionError(f"partition {self.name!r}: pin count in tier {tier!r} would go negative")
        if n:
            pins[tier] = n
        else:
            pins.pop(tier, None)
        self._pins = MappingProxyType(pins)
        return n

    def _set_checksum(self, tier: str, crc: int | None) -> None:
        sums = dict(self._checksums)
        if crc is None:
            sums.pop(tier, None)
        else:
            sums[tier] = crc
        self._checksums = MappingProxyType(sums)
