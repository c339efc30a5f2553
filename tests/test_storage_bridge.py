"""The one I/O bridge: a bound on concurrent blocking calls, limiters, cancellation, hand-over."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from tiers_support import MemBackend

from tiered.storage import CapacityLimiter, IOBridge, default_bridge, open_backend
from tiered.tiers import Tier, TierManager


def _tracker():
    lock = threading.Lock()
    active = [0, 0]

    def work(sleep_s: float = 0.02) -> None:
        with lock:
            active[0] += 1
            active[1] = max(active[1], active[0])
        time.sleep(sleep_s)
        with lock:
            active[0] -= 1

    return work, active


def test_bridge_bounds_concurrent_calls_and_returns_results():
    bridge = IOBridge(3, name="t-bridge")
    work, active = _tracker()

    async def main():
        await bridge.run_all([(work,) for _ in range(12)])
        return await bridge.run(lambda a, b: a + b, 2, 5)

    try:
        assert asyncio.run(main()) == 7
        assert active[1] == 3
    finally:
        bridge.close()


def test_limiter_bounds_one_callers_share_of_a_wider_bridge():
    bridge = IOBridge(8, name="t-bridge")
    limiter = CapacityLimiter(2)
    work, active = _tracker()
    try:
        asyncio.run(bridge.run_all([(work,) for _ in range(10)], limiter=limiter))
        assert active[1] == 2
        assert limiter.borrowed_tokens == 0
    finally:
        bridge.close()


def test_cancel_returns_only_once_running_calls_stopped_and_skips_queued_ones():
    bridge = IOBridge(2, name="t-bridge")
    limiter = CapacityLimiter(2)
    started, finished = [], []

    def work(i: int) -> None:
        started.append(i)
        time.sleep(0.05)
        finished.append(i)

    async def main():
        task = asyncio.ensure_future(bridge.run_all([(work, i) for i in range(20)], limiter=limiter))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(started) == sorted(finished), "returned while a call was still running"

    try:
        asyncio.run(main())
        assert len(started) < 20, "queued calls ran after the cancel"
        assert limiter.borrowed_tokens == 0
    finally:
        bridge.close()


def test_a_failure_propagates_after_the_others_stopped():
    bridge = IOBridge(4, name="t-bridge")
    running = [0]
    lock = threading.Lock()

    def slow() -> None:
        with lock:
            running[0] += 1
        time.sleep(0.05)
        with lock:
            running[0] -= 1

    def bad() -> None:
        raise OSError(5, "injected")

    try:
        with pytest.raises(OSError, match="injected"):
            asyncio.run(bridge.run_all([(slow,), (bad,), (slow,)]))
        assert running[0] == 0
    finally:
        bridge.close()


def test_bad_bounds_are_errors():
    with pytest.raises(ValueError, match="max_concurrency"):
        IOBridge(0)
    with pytest.raises(ValueError, match="total_tokens"):
        CapacityLimiter(0)


def test_manager_hands_its_bridge_to_every_backend_and_open_backend_takes_one(tmp_path: Path):
    a, b = MemBackend(), MemBackend()
    assert a.bridge is default_bridge()
    m = TierManager([Tier("gpu", a), Tier("cpu", b)], io_threads=3)
    try:
        assert a.bridge is b.bridge is m._loop.bridge
        assert a.bridge.max_concurrency == 3
    finally:
        m.close(close_backends=False)
    assert a.bridge is default_bridge(), "a closed manager's bridge must not outlive it in its backends"
    nv = open_backend({"type": "nvme", "path": str(tmp_path), "io_threads": 5})
    m = TierManager([Tier("cpu", MemBackend()), Tier("nvme", nv)], io_threads=3)
    try:
        assert nv.bridge.max_concurrency == 3 + 5, "the bridge is widened by the backend's own share"
    finally:
        m.close()
    mine = IOBridge(2, name="t-bridge")
    try:
        nv = open_backend({"type": "nvme", "path": str(tmp_path)}, bridge=mine)
        assert nv.bridge is mine
    finally:
        mine.close()


def test_nvme_syscalls_never_run_on_the_event_loop_thread(tmp_path: Path, monkeypatch):
    nv = open_backend({"type": "nvme", "path": str(tmp_path), "fsync": False})
    on_loop: list[str] = []
    loop_thread: list[threading.Thread] = []

    def spy(name, real):
        def call(*args, **kwargs):
            if loop_thread and threading.current_thread() is loop_thread[0]:
                on_loop.append(name)
            return real(*args, **kwargs)

        return call

    for name in ("open", "replace", "fstat", "unlink", "ftruncate"):
        monkeypatch.setattr(os, name, spy(name, getattr(os, name)))

    async def main():
        loop_thread.append(threading.current_thread())
        t = torch.arange(5000, dtype=torch.uint8)
        await nv.write("k", t)
        out = torch.empty_like(t)
        await nv.read("k", out)
        assert torch.equal(out, t)
        assert await nv.exists("k")
        await nv.delete("k")
        await nv.close()

    asyncio.run(main())
    assert on_loop == [], f"blocking syscalls ran on the event loop: {on_loop}"
