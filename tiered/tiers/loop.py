"""One asyncio loop in one daemon thread, and the one bridge from it into a bounded thread pool.

[Note: one loop, one bridge]
All tier-manager state is mutated on a single event loop that runs in a single daemon thread,
so the state needs no locks: a transition is a few synchronous statements between two awaits.
The training thread never awaits; it submits coroutines (`submit`) or small synchronous
functions (`call`) and gets `concurrent.futures.Future`s back. Blocking work (tensor copies,
checksums, and every tier backend's own blocking I/O) goes through the loop's one `IOBridge`
(`bridge`, [Note: one I/O bridge] in `tiered.storage.bridge`): the manager hands it to each tier's
backend, and its own copies and checksums use `run_blocking`. So the loop itself never blocks and
the number of OS threads doing I/O for one manager is bounded: ``io_threads`` for its own copies
and checksums, plus the share each backend declares (``io_concurrency``) and bounds itself to.

The thread starts lazily on first use, so creating a manager is free and a process that never
moves a byte never starts a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from tiered.errors import ManagerClosedError, TieredError, TierTimeoutError
from tiered.storage.bridge import CapacityLimiter, IOBridge

log = logging.getLogger(__name__)

T = TypeVar("T")


class EventLoopThread:
    """A lazily started daemon thread running one asyncio loop. See [Note: one loop, one bridge]."""

    def __init__(self, *, io_threads: int = 8, name: str = "tiered-tiers", backend_threads: int = 0) -> None:
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self._name = name
        self.bridge = IOBridge(io_threads + backend_threads, name=f"{name}-io")
        """The bounded bridge into blocking calls, shared with the tiers' backends: ``io_threads``
        for `run_blocking`, plus ``backend_threads`` for the backends' own bounded shares."""
        self._limiter = CapacityLimiter(io_threads, name=f"{name} copies") if backend_threads else None
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    # ---- lifecycle ------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._loop is not None

    @property
    def closed(self) -> bool:
        return self._closed

    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, starting the thread on first use."""
        loop = self._loop
        if loop is not None and not self._closed:
            return loop
        with self._lock:
            if self._closed:
                raise ManagerClosedError(f"{self._name}: the event loop is closed; create a new manager")
            if self._loop is None:
                ready = threading.Event()
                loop = asyncio.new_event_loop()

                def _run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                self._thread = threading.Thread(target=_run, name=f"{self._name}-loop", daemon=True)
                self._thread.start()
                if not ready.wait(timeout=30.0):
                    raise TierTimeoutError(f"{self._name}: the event loop thread did not start within 30 s")
                self._loop = loop
            return self._loop

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def close(
        self, timeout_s: float = 30.0, final: Callable[[float], Coroutine[Any, Any, None]] | None = None
    ) -> None:
        """Cancel every task still running, run `final(seconds_left)` (if given), stop the loop,
        join the thread. Idempotent. A TieredError from `final` (a backend that would not close,
        [Note: bounded close]) is raised once the loop has stopped; so is a loop too blocked to
        close within `timeout_s`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            self.bridge.close()
            return
        if self.in_loop_thread():
            raise RuntimeError(f"{self._name}: close() called from the loop thread itself")

        # one deadline for the whole close, not one per stage ([Note: one deadline per request])
        end = time.monotonic() + timeout_s

        def left() -> float:
            return max(0.0, end - time.monotonic())

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:  # at most half the time: the backends' close (removing swap files) gets the rest
                await asyncio.wait(tasks, timeout=left() / 2)
            if final is not None:
                await final(left())  # bounds itself, so that its own error (naming what hung) comes first

        error: BaseException | None = None
        try:
            # the grace lets `final`'s error, raised at the deadline, arrive before this wait ends
            asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(
                timeout=left() + 0.05 * timeout_s + 0.1
            )
        except TieredError as exc:
            error = exc
        except concurrent.futures.TimeoutError:
            error = TierTimeoutError(
                f"{self._name}: closing did not finish within {timeout_s:.3g} s (tiered.timeout_s): "
                "the event loop is blocked (a backend call that holds it?)"
            )
        except Exception as exc:  # noqa: BLE001 - a stuck task must not keep close() from stopping the loop
            log.warning("%s: closing did not finish cleanly within %.1f s: %r", self._name, timeout_s, exc)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=max(left(), 0.05 * timeout_s))
        if thread.is_alive():
            log.warning("%s: loop thread did not stop within %.1f s", self._name, timeout_s)
        else:
            loop.close()
        self.bridge.close(wait=False)
        if error is not None:
            raise error

    # ---- entry points from other threads ---------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; the returned future completes with its result."""
        try:
            loop = self.loop()
        except BaseException:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def call(self, fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
        """Run the synchronous `fn(*args)` on the loop thread and return its result (or raise)."""
        if self.in_loop_thread():
            return fn(*args)
        loop = self.loop()
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def _do() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                fut.set_exception(exc)

        loop.call_soon_threadsafe(_do)
        try:
            return fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TierTimeoutError(
                f"{self._name}: {getattr(fn, '__name__', fn)} did not run on the loop within {timeout_s} s "
                "(the loop is blocked or closed)"
            ) from None

    # ---- inside coroutines -----------------------------------------------------------------
    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking `fn(*args)` on the loop's bounded `bridge`; a cancel waits for it to stop."""
        if self.bridge.closed:
            raise ManagerClosedError(f"{self._name}: the thread pool is closed")
        return await self.bridge.run(fn, *args, limiter=self._limiter)
