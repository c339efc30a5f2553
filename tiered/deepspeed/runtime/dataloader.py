"""``deepspeed.runtime.dataloader.RepeatingLoader``: iterate a loader forever, restarting it at its end."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["RepeatingLoader"]


class RepeatingLoader:
    """Wraps an iterable so that ``next`` never raises StopIteration: a new pass starts instead."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
