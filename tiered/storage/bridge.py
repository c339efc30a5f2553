"""`IOBridge`: the one bounded way from an event loop into blocking calls.

[Note: one I/O bridge]
A backend's blocking work (``os.open``, ``pwritev``, ``fsync``, ``unlink``, a large memcpy) must
never run on the event loop: one slow syscall there stalls every move of every tier. It goes
through an `IOBridge` instead: ``await bridge.run(fn, *args)``. A bridge is one thread pool with a
hard bound on the calls running at once (``max_concurrency`` worker threads), shared by everyone
handed it, so the number of OS threads doing I/O in a process is known, and it does not depend on
how many backends are open.

Who hands it in: whoever opens the backend. The tier manager gives every tier's backend the bridge
of its loop (`StorageBackend.use_bridge`), sized ``io_threads`` plus each backend's declared share
(``io_concurrency``), so one known bound covers all of its I/O;
``tiered.open_backend(spec, bridge=...)`` passes one too. A backend opened directly, used on its
own, falls back to `default_bridge()`, one lazily started process-wide bridge.

A caller that must bound its own share of a bridge (the nvme backend: one bounce buffer per call
in flight) passes a `CapacityLimiter` (anyio's idea): calls past its ``total_tokens`` wait in a
queue, not in a thread, and start as earlier ones finish. Limiters are plain thread-safe objects
with no event loop of their own, so one backend may be used from several loops.

Cancellation: a running syscall cannot be interrupted, and the buffer and file descriptor it uses
must stay valid until it returns. So a cancelled or failed `run` / `run_all` cancels the calls
that have not started and returns only once none is still running (bounded by ``drain_s``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tiered.errors import StorageIOError

log = logging.getLogger(__name__)
T = TypeVar("T")

DRAIN_S = 120.0
"""How long a cancelled or failed call waits for syscalls still running (they cannot be stopped)."""


class CapacityLimiter:
    """At most `total_tokens` calls of one caller running on a bridge at once. Thread-safe."""

    def __init__(self, total_tokens: int, *, name: str = "limiter") -> None:
        if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 1:
            raise ValueError(f"{name}: total_tokens must be a positive int, got {total_tokens!r}")
        self.total_tokens = total_tokens
        self.name = name
        self._lock = threading.Lock()
        self._running = 0
        self._queue: collections.deque[tuple[concurrent.futures.Future[Any], Callable[[], None]]] = (
            collections.deque()
        )

    @property
    def borrowed_tokens(self) -> int:
        with self._lock:
            return self._running

    def _admit(self, fut: concurrent.futures.Future[Any], start: Callable[[], None]) -> None:
        with self._lock:
            if self._running >= self.total_tokens:
                self._queue.append((fut, start))
                return
            self._running += 1
        if fut.set_running_or_notify_cancel():
            start()
        else:
            self._release()

    def _release(self) -> None:
        """Return a token, or hand it to the next queued call. A queued call that was cancelled
        meanwhile is skipped; set_running_or_notify_cancel also tells concurrent.futures.wait()."""
        while True:
            with self._lock:
                if not self._queue:
                    self._running -= 1
                    return
                fut, start = self._queue.popleft()
            if fut.set_running_or_notify_cancel():
                start()  # the token we held passes to it
                return


class IOBridge:
    """One bounded thread pool for blocking calls. See [Note: one I/O bridge]."""

    def __init__(self, max_concurrency: int = 8, *, name: str = "tiered-io") -> None:
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(
                f"io bridge {name!r}: max_concurrency must be a positive int, got {max_concurrency!r}"
            )
        self.max_concurrency = max_concurrency
        self.name = name
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def executor(self) -> concurrent.futures.Executor:
        """The bounded pool itself, for a library that takes an executor (aiofiles, run_in_executor)."""
        with self._lock:
            if self._closed:
                raise StorageIOError(f"io bridge {self.name!r} is closed")
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.max_concurrency, thread_name_prefix=self.name
                )
            return self._pool

    def submit(
        self, fn: Callable[..., T], *args: Any, limiter: CapacityLimiter | None = None
    ) -> concurrent.futures.Future[T]:
        """Start `fn(*args)` on the pool (after a token of `limiter`, if given); any thread."""
        pool = self.executor
        if limiter is None:
            return pool.submit(fn, *args)
        outer: concurrent.futures.Future[T] = concurrent.futures.Future()

        def start() -> None:
            try:
                inner = pool.submit(fn, *args)
            except BaseException as exc:  # noqa: BLE001 - the pool shut down meanwhile: fail this call, free the token
                limiter._release()
                outer.set_exception(exc)
                return

            def done(f: concurrent.futures.Future[T]) -> None:
                limiter._release()
                _copy_outcome(f, outer)

            inner.add_done_callback(done)

        limiter._admit(outer, start)
        return outer

    async def run(self, fn: Callable[..., T], *args: Any, limiter: CapacityLimiter | None = None) -> T:
        """``fn(*args)`` off the loop; a cancelled caller returns only once the call stopped."""
        result: T = (await self.run_all([(fn, *args)], limiter=limiter))[0]
        return result

    async def run_all(
        self,
        calls: Sequence[tuple[Any, ...]],
        *,
        limiter: CapacityLimiter | None = None,
        drain_s: float = DRAIN_S,
    ) -> list[Any]:
        """Run ``fn(*args)`` for each ``(fn, *args)`` of `calls` concurrently; their results.

        On the first failure, or a cancel, the calls not yet started are cancelled and this
        returns (raising) only once none still runs: their buffers and descriptors stay valid."""
        futures = [self.submit(*call, limiter=limiter) for call in calls]
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except BaseException:
            for f in futures:
                f.cancel()
            _, pending = concurrent.futures.wait(futures, timeout=drain_s)
            if pending:
                log.error(
                    "io bridge %r: %d blocking calls still running after %.0f s",
                    self.name,
                    len(pending),
                    drain_s,
                )
            raise

    def close(self, *, wait: bool = False) -> None:
        """Stop accepting calls; cancel queued ones. Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)

    def __repr__(self) -> str:
        return f"IOBridge({self.name!r}, max_concurrency={self.max_concurrency})"


def _copy_outcome(src: concurrent.futures.Future[T], dst: concurrent.futures.Future[T]) -> None:
    if src.cancelled():  # the pool shut down under a queued call; `dst` is running: fail it
        dst.set_exception(concurrent.futures.CancelledError())
        return
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


_default: IOBridge | None = None
_default_lock = threading.Lock()


def default_bridge() -> IOBridge:
    """The process-wide bridge of backends nobody handed one (opened directly, used alone)."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = IOBridge(8, name="tiered-io-default")
        return _default
