"""EventLoopThread: lazy start, the bounded blocking bridge, clean shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from tiers_support import MemBackend

from tiered.tiers import EventLoopThread, ManagerClosedError, Tier, TierManager


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tiered-tiers-loop")]


def test_thread_starts_lazily_and_stops_on_close():
    before = len(_loop_threads())
    lt = EventLoopThread(io_threads=2)
    assert not lt.started and len(_loop_threads()) == before
    assert lt.submit(asyncio.sleep(0, result=5)).result(timeout=5) == 5
    assert lt.started and len(_loop_threads()) == before + 1
    lt.close()
    lt.close()
    assert len(_loop_threads()) == before
    with pytest.raises(ManagerClosedError, match="closed"):
        lt.submit(asyncio.sleep(0))


def test_a_manager_that_never_moves_bytes_starts_no_thread():
    before = len(_loop_threads())
    m = TierManager([Tier("cpu", MemBackend())])
    assert len(_loop_threads()) == before
    m.close(close_backends=False)


def test_run_blocking_is_bounded_by_io_threads():
    lt = EventLoopThread(io_threads=3)
    lock = threading.Lock()
    active = [0, 0]

    def work():
        with lock:
            active[0] += 1
            active[1] = max(active[1], active[0])
        time.sleep(0.02)
        with lock:
            active[0] -= 1

    async def many():
        await asyncio.gather(*[lt.run_blocking(work) for _ in range(12)])

    try:
        lt.submit(many()).result(timeout=30)
        assert active[1] == 3
    finally:
        lt.close()


def test_call_runs_on_the_loop_thread_and_reraises():
    lt = EventLoopThread()
    try:
        names = lt.call(lambda: threading.current_thread().name)
        assert names.startswith("tiered-tiers-loop")

        def boom():
            raise KeyError("inside the loop")

        with pytest.raises(KeyError, match="inside the loop"):
            lt.call(boom)

        async def nested():
            return lt.call(lambda: 7)  # from the loop thread itself: runs inline, no deadlock

        assert lt.submit(nested()).result(timeout=5) == 7
    finally:
        lt.close()


def test_close_cancels_pending_coroutines():
    lt = EventLoopThread()
    fut = lt.submit(asyncio.sleep(3600))
    time.sleep(0.05)
    lt.close(timeout_s=5)
    assert fut.cancelled()
