"""Every wait of the state machine has a deadline: a change signal, a shielded wait, a bounded call.

Nothing on the loop waits forever ([Note: reserve before move] in `tiered.tiers.state_machine`):
a request short of room waits for a `ChangeSignal`, a request meeting a move in flight waits for
that move's future (shielded, so a timed-out waiter never cancels the move other waiters share),
and a backend call is bounded by the manager's timeout. A wait that runs out raises a marked
TierTimeoutError whose message the caller wrote ([Note: error context]).

[Note: one deadline per request]
``timeout_s`` is what a caller waits for one request (a fetch, prefetch, evict, flush), not what
each of its inner waits may take: a write-back queued behind a hung one on its link used to wait
``timeout_s`` for the link and then ``timeout_s`` more for the backend, and a request that also
waited for room or for a move in flight stacked a third, so a hung backend with ``timeout_s: 20``
failed after 60 s and more. So the manager runs each request under `request_deadline` (a context
variable, inherited by the moves the request starts): every wait inside it (`deadline_after`,
`bounded`) ends at the earlier of its own bound and the request's deadline. A move another
request joins keeps the deadline of the request that started it; a waiter that times out on it
reports the move's own error when the move failed at the same instant (it names the backend
and key).

[Note: bounded close]
Closing a manager closes its tiers' backends (a swap backend removes its folder then). They are
closed all at once, each with ``timeout_s``, not one after another: one hung backend (a dead
mount, an injected hang) must neither keep the others open nor add its wait to theirs. The close
of the whole manager is bounded by ``timeout_s`` too (no fixed cap: a configured timeout above
it was cut, one below it was not honoured), and a backend still closing at the deadline is a
TierTimeoutError naming it and its tier, raised after the loop stopped, so a hang is an error
the user sees rather than a log line or a stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from tiered.errors import TierTimeoutError
from tiered.storage.base import StorageBackend
from tiered.tiers.error_context import mark

log = logging.getLogger(__name__)

T = TypeVar("T")


_REQUEST_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "tiered_request_deadline", default=None
)


async def request_deadline(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """Run `coro` with every wait in it ending `timeout_s` from now ([Note: one deadline per
    request]); a nested request keeps the outer, earlier deadline."""
    mine = asyncio.get_running_loop().time() + timeout_s
    outer = _REQUEST_DEADLINE.get()
    token = _REQUEST_DEADLINE.set(mine if outer is None else min(outer, mine))
    try:
        return await coro
    finally:
        _REQUEST_DEADLINE.reset(token)


@contextlib.contextmanager
def outside_request() -> Iterator[None]:
    """The cleanup of a failed request (freeing its buffer) gets its own bounds, not the spent
    deadline of the request ([Note: one deadline per request])."""
    token = _REQUEST_DEADLINE.set(None)
    try:
        yield
    finally:
        _REQUEST_DEADLINE.reset(token)


def deadline_after(timeout_s: float) -> float:
    """The loop time `timeout_s` from now, or the request's deadline if that is earlier."""
    own = asyncio.get_running_loop().time() + timeout_s
    req = _REQUEST_DEADLINE.get()
    return own if req is None else min(own, req)


def _left_s(timeout_s: float) -> tuple[float, bool]:
    """(seconds a wait of `timeout_s` may take, whether the request's deadline is what bounds it)."""
    req = _REQUEST_DEADLINE.get()
    if req is None:
        return timeout_s, False
    left = max(0.0, req - asyncio.get_running_loop().time())
    return (left, True) if left < 0.99 * timeout_s else (timeout_s, False)


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
        await asyncio.sleep(0)  # a move bounded by the same deadline fails in this same instant
        err = fut.exception() if fut.done() and not fut.cancelled() else None
        if err is not None:
            raise err from None  # its message names the backend and key
        move = getattr(fut, "tiered_move", None)
        raise mark(TierTimeoutError(describe() + (f"; the move waited on: {move}" if move else ""))) from None


async def bounded(aw: Awaitable[T], timeout_s: float, describe: Callable[[], str]) -> T:
    """`aw` (a backend call, a semaphore), cancelled with TierTimeoutError after `timeout_s` (or
    when the request's deadline comes first, [Note: one deadline per request])."""
    left, by_request = _left_s(timeout_s)
    try:
        return await asyncio.wait_for(aw, left)
    except TimeoutError:
        msg = describe()
        if by_request:
            msg += f" (the call had {left:.3g} s left of its request's tiered.timeout_s)"
        raise mark(TierTimeoutError(msg)) from None


async def close_all(backends: Sequence[tuple[str, StorageBackend]], timeout_s: float) -> None:
    """Close every `(tier, backend)` at once, each given `timeout_s`; a close that fails is
    logged, one that runs out raises TierTimeoutError naming it. See [Note: bounded close]."""
    tasks = {asyncio.ensure_future(b.close()): (tier, b) for tier, b in backends}
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=max(0.0, timeout_s))
    for t in done:
        if not t.cancelled() and t.exception() is not None:
            tier, b = tasks[t]
            log.error("closing backend %r of tier %r failed", b.name, tier, exc_info=t.exception())
    if not pending:
        return
    for t in pending:
        t.cancel()
    # a close stuck in a blocking call ignores the cancel; do not wait for it
    await asyncio.wait(pending, timeout=0.05)
    hung = ", ".join(f"backend {tasks[t][1].name!r} of tier {tasks[t][0]!r}" for t in pending)
    raise TierTimeoutError(
        f"closing {hung} did not finish within {timeout_s:.3g} s (tiered.timeout_s); the other backends "
        "were closed. Its files (a swap folder) may be left behind: check the storage under it, or "
        "raise tiered.timeout_s if its close is only slow"
    )
