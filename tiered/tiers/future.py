"""`TierFuture`: what the training thread holds instead of an asyncio object."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from tiered.errors import TierTimeoutError
from tiered.tiers.loop import ManagerClosedError

T = TypeVar("T")


class TierFuture(Generic[T]):
    """The pending result of a tier operation.

    ``result()`` blocks; the time it blocks is the "stall" the manager records (per tier), the
    number a good prefetch schedule drives to zero. Errors raised on the loop are re-raised here
    with their context (partition, tier, operation, backend key) already in the message.
    """

    __slots__ = ("_fut", "_what", "_tier", "_default_timeout_s", "_on_stall")

    def __init__(
        self,
        fut: concurrent.futures.Future[T],
        *,
        what: str,
        tier: str | None,
        default_timeout_s: float | None,
        on_stall: Callable[[str | None, float], None] | None = None,
    ) -> None:
        self._fut = fut
        self._what = what
        self._tier = tier
        self._default_timeout_s = default_timeout_s
        self._on_stall = on_stall

    @classmethod
    def completed(cls, value: T, *, what: str = "noop", tier: str | None = None) -> TierFuture[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        fut.set_result(value)
        return cls(fut, what=what, tier=tier, default_timeout_s=None)

    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout: float | None = None) -> T:
        """Block until done (at most `timeout` s, default the manager's ``timeout_s``)."""
        if timeout is None:
            timeout = self._default_timeout_s
        if self._fut.done():
            return self._get(0)
        t0 = time.perf_counter()
        try:
            return self._get(timeout)
        finally:
            if self._on_stall is not None:
                self._on_stall(self._tier, time.perf_counter() - t0)

    def _get(self, timeout: float | None) -> T:
        try:
            return self._fut.result(timeout=timeout)
        except concurrent.futures.CancelledError:
            raise ManagerClosedError(f"{self._what} was cancelled: the tier manager was closed") from None
        except TimeoutError:
            if self._fut.done():  # the operation itself failed with a timeout: keep its message
                raise
            raise TierTimeoutError(
                f"{self._what} did not finish within {timeout} s; the operation keeps running "
                "(raise the manager's timeout_s, or check for pinned partitions that are never released)"
            ) from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except BaseException as exc:  # noqa: BLE001 - returned, not swallowed
            return exc
        return None

    def __repr__(self) -> str:
        return f"TierFuture({self._what}, done={self.done()})"
