"""Opening, running and closing a stripe set's member backends.

[Note: all-or-nothing member calls]
`run_all` is ``asyncio.gather`` with the guarantee a stripe needs: when it returns or raises, no
member call still runs. A stripe read writes into the caller's tensor and a stripe write reads from
it, so returning while a sibling still touches that memory (gather does, after the first error)
would hand the caller a buffer someone else is using. On the first error the other calls are
cancelled and awaited; the first error (in stripe order) is raised as it is, not as a group.

`finish_all` is the same except for a cancel from outside: it does not pass it on to the calls
but waits for them to finish, then raises CancelledError. An in-place stripe write runs through it
([Note: stripe scratch mode]): cut short by a cancel it would leave the key's stripes a mix of two
versions, finished it leaves the new one whole (the contract lets a cancelled write commit, as long
as it does so before the cancelled call returns). An error of one call still cancels the others,
and wins over a cancel: the caller must learn that the stripes are a mix.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from tiered.storage.base import StorageBackend

log = logging.getLogger(__name__)
T = TypeVar("T")
_CLOSE_TIMEOUT_S = 60.0


def close_now(backends: Sequence[StorageBackend]) -> None:
    """Close backends from synchronous code (a constructor that failed half way): on a thread with
    its own loop, because the caller may itself run inside one."""

    def main() -> None:
        async def close_all() -> None:
            for b in backends:
                try:
                    await b.close()
                except Exception:
                    log.exception("closing %r after a failed stripe set-up failed", b)

        asyncio.run(close_all())

    t = threading.Thread(target=main, name="tiered-stripe-close", daemon=True)
    t.start()
    t.join(_CLOSE_TIMEOUT_S)
    if t.is_alive():
        log.error("stripe backend: closing members after a failed set-up took over %.0f s", _CLOSE_TIMEOUT_S)


async def run_all(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Run `calls` concurrently. See [Note: all-or-nothing member calls]."""
    return await _run(calls, finish=False)


async def finish_all(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Run `calls` concurrently to their end even when cancelled. See [Note: all-or-nothing member calls]."""
    return await _run(calls, finish=True)


async def _run(calls: Sequence[Awaitable[T]], *, finish: bool) -> list[T]:
    tasks = [asyncio.ensure_future(c) for c in calls]
    if not tasks:
        return []
    cancelled = False
    while True:
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            cancelled = True
            if finish:  # keep waiting: the calls run on, the cancel is raised once they are done
                continue
        break
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True  # a second cancel: the calls must still stop before we return
        pending = [t for t in pending if not t.done()]
    errors = [e for t in tasks if not t.cancelled() and (e := t.exception()) is not None]
    if finish and errors:
        raise errors[0]
    if cancelled:
        raise asyncio.CancelledError
    if errors:
        raise errors[0]
    return [t.result() for t in tasks]
