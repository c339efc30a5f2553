"""`Tier`: a storage backend plus a hard byte budget."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tiered.storage.base import StorageBackend

_NAME_RE = re.compile(r"^[A-Za-z0-9_\-]+$")


@dataclass(frozen=True)
class Tier:
    """A backend plus a hard byte budget.

    ``budget_bytes=None`` means the backend's ``capacity().free_bytes`` when it knows it, and
    unbounded otherwise. Names are short identifiers ("gpu", "cpu", "nvme", or custom); links
    between tiers are named "src->dst" in stats and traces.
    """

    name: str
    backend: StorageBackend
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        check_tier_name(self.name)
        if not isinstance(self.backend, StorageBackend):
            raise TypeError(
                f"tier {self.name!r}: backend must be a tiered.storage.StorageBackend, "
                f"got {type(self.backend).__name__} (open one with tiered.open_backend)"
            )
        if self.budget_bytes is not None and (
            isinstance(self.budget_bytes, bool)
            or not isinstance(self.budget_bytes, int)
            or self.budget_bytes < 0
        ):
            raise ValueError(
                f"tier {self.name!r}: budget_bytes must be a non-negative int or None, got {self.budget_bytes!r} "
                "(use tiered.units.parse_bytes for strings like '2GiB')"
            )

    def resolved_budget(self) -> int | None:
        """The budget the manager enforces: the explicit one, else the backend's free bytes."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        try:
            return self.backend.capacity().free_bytes
        except Exception:  # noqa: BLE001 - a backend that cannot tell is unbounded, as documented
            return None


def check_tier_name(name: object) -> None:
    """ValueError unless `name` can name a tier (it becomes part of file and trace names)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"tier name {name!r}: use letters, digits, '_' and '-' only")
