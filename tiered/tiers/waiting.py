"""Every wait of the state machine has a deadline: a change signal, a shielded wait, a bounded call.

Nothing on the loop waits forever ([Note: reserve before move] in `tiered.tiers.state_machine`):
a request short of room waits for a `ChangeSignal`, a request meeting a move in flight waits for
that move's future (shielded, so a timed-out waiter never cancels the move other waiters share),
and a backend call is bounded by the manager's timeout. A wait that runs out raises a marked
TierTimeoutError whose message the caller wrote ([Note: error context]).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tiered.errors import TierTimeoutError
from tiered.tiers.error_context import mark

T = TypeVar("T")


def deadline_after(timeout_s: float) -> float:
    """The loop time `timeout_s` from now."""
    return asyncio.get_running_loop().time() + timeout_s


class ChangeSignal:
    """Wakes every waiter when something changed (a release, a finished move, bytes freed)."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, deadline: float, describe: Callable[[], str]) -> None:
        """Until the next `notify`, or TierTimeoutError(describe()) at `deadline`."""
        if self._event is None:
            self._event = asyncio.Event()
        ev = self._event
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise mark(TierTimeoutError(describe()))
        try:
            await asyncio.wait_for(ev.wait(), remaining)
        except TimeoutError:
            raise mark(TierTimeoutError(describe())) from None


async def wait_done(fut: asyncio.Future[None], deadline: float, describe: Callable[[], str]) -> None:
    """Wait for a move in flight that others share (shielded) until `deadline`; its error, if
    any, is raised here too."""
    remaining = deadline - asyncio.get_running_loop().time()
    try:
        await asyncio.wait_for(asyncio.shield(fut), max(0.0, remaining))
    except TimeoutError:
        raise mark(TierTimeoutError(describe())) from None


async def bounded(aw: Awaitable[T], timeout_s: float, describe: Callable[[], str]) -> T:
    """`aw` (a backend call, a semaphore), cancelled with TierTimeoutError after `timeout_s`."""
    try:
        return await asyncio.wait_for(aw, timeout_s)
    except TimeoutError:
        raise mark(TierTimeoutError(describe())) from None
