"""The residency plan's answer as values: what each tier keeps across steps, and what it knows
of a tier's budget ([Note: residency] in tiered/planning/residency.py, which computes it; the
bytes formula of traffic.py and the engine read it)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

KIND_ORDER = {"param": 0, "grad": 1, "state": 2}
"""The kinds of partition a tier keeps, in the order ties between them are broken."""


@dataclass(frozen=True)
class TierRoom:
    """What the residency plan knows of a tier's budget ([Note: residency])."""

    budget_bytes: int | None
    """The budget the tier manager enforces (the user's, or what the backend reported free)."""
    explicit: bool = True
    """The user gave it (``tiered.tiers.<name>.budget``, or a memory the planner was told)."""
    total_bytes: int | None = None
    """The memory the tier's backend has in all (the implicit reserve's base)."""
    local_ranks: int = 1
    """Ranks of this host sharing an implicit budget."""


@dataclass(frozen=True)
class KeptPartition:
    """One partition kept in a faster tier, and what keeping it saves."""

    name: str
    kind: str
    """ "param", "grad" or "state"."""
    part: str
    """What it holds of its group: "param", "grad", "master", "exp_avg" or "exp_avg_sq"."""
    group: int
    """Its group's index."""
    tier: str
    nbytes: int
    saved_bytes_per_step: int
    """Disk bytes (reads + writes) it saves per optimizer step ([Note: residency])."""
    warm: bool = False
    """Read into its tier at initialize: no step brings it there (a frozen parameter, only ever
    gathered); the others arrive with their first use."""


@dataclass(frozen=True)
class Residency:
    """What each tier keeps ([Note: residency]); empty when nothing is (``tiered.residency: "off"``)."""

    kept: tuple[KeptPartition, ...] = ()
    room: Mapping[str, int] = field(default_factory=dict)
    """Per tier, the bytes it had for kept copies."""

    @functools.cached_property
    def _tier_by_name(self) -> dict[str, str]:
        return {k.name: k.tier for k in self.kept}

    @functools.cached_property
    def _bytes_by_group(self) -> dict[tuple[int, str], int]:
        out: dict[tuple[int, str], int] = {}
        for k in self.kept:
            out[(k.group, k.part)] = out.get((k.group, k.part), 0) + k.nbytes
        return out

    def tier_of(self, name: str) -> str | None:
        """The tier that keeps partition `name`, or None."""
        return self._tier_by_name.get(name)

    def groups(self, part: str) -> frozenset[int]:
        """The groups whose `part` ("param", "grad", ...) is kept, whole."""
        return frozenset(k.group for k in self.kept if k.part == part)

    def kept_bytes(self, group: int, part: str) -> int:
        """Bytes of group `group`'s `part` kept (a state's tiles summed)."""
        return self._bytes_by_group.get((group, part), 0)  # looked up per group: indexed once

    def names(self, kind: str | None = None) -> frozenset[str]:
        return frozenset(k.name for k in self.kept if kind is None or k.kind == kind)

    def bytes_in(self, tier: str, kind: str | None = None) -> int:
        return sum(k.nbytes for k in self.kept if k.tier == tier and (kind is None or k.kind == kind))

    def saved_bytes_per_step(self) -> int:
        return sum(k.saved_bytes_per_step for k in self.kept)

    def summary(self) -> dict[str, dict[str, int]]:
        """Per tier: the room and the bytes kept, by kind (what `stats()` and the plan print)."""
        out: dict[str, dict[str, int]] = {}
        for tier, room in self.room.items():
            row = {"room": int(room), "kept": self.bytes_in(tier)}
            for kind in KIND_ORDER:
                row[kind] = self.bytes_in(tier, kind)
            out[tier] = row
        return out
