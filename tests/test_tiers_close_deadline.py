"""Closing is bounded by `timeout_s` too ([Note: bounded close]): the tiers' backends close all at
once, each within `timeout_s`, and one that hangs is a TierTimeoutError naming it, its tier and
`tiered.timeout_s`, the other backends closed all the same.

The bound asserted (1.1 x timeout_s + 0.6 s of scheduling slack) is what the engine promises, not
a performance figure; the old code closed backends one after another with no bound of their own,
cut the close at 60 s and only logged what hung."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from tiers_support import DiskBackend, MemBackend

from tiered.engine.build import _close_backends
from tiered.errors import TierTimeoutError
from tiered.tiers import Tier, TierManager

T = 1.5


def _bound() -> float:
    return 1.1 * T + 0.6


class _Closing(MemBackend):
    """Records its close, so a test sees the others were closed while one hung."""

    def __init__(self) -> None:
        super().__init__()
        self.closed_ok = False

    async def close(self) -> None:
        self.closed_ok = True


class _HangsOnLoop(DiskBackend):
    """Its close awaits forever (a dead mount seen through an async client); a cancel ends it."""

    name = "hang-on-loop"

    async def close(self) -> None:
        await asyncio.Event().wait()


class _HangsInThread(DiskBackend):
    """Its close blocks in a thread and ignores cancellation (an uninterruptible syscall)."""

    name = "hang-in-thread"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.release = threading.Event()

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 30.0)


def _manager(tmp_path: Path, hung: DiskBackend) -> tuple[TierManager, list[_Closing]]:
    fast = [_Closing(), _Closing()]
    tiers = [Tier("gpu", fast[0], 4096), Tier("cpu", fast[1], 16384), Tier("nvme", hung, None)]
    return TierManager(tiers, timeout_s=T), fast


@pytest.mark.parametrize("kind", [_HangsOnLoop, _HangsInThread])
def test_a_hung_backend_fails_close_in_time_naming_it_and_the_others_close(
    tmp_path: Path, kind: type[DiskBackend]
) -> None:
    hung = kind(tmp_path / "nvme")
    m, fast = _manager(tmp_path, hung)
    t0 = time.perf_counter()
    try:
        with pytest.raises(TierTimeoutError) as ei:
            m.close()
        took = time.perf_counter() - t0
    finally:
        if isinstance(hung, _HangsInThread):
            hung.release.set()
    assert took < _bound(), f"close failed after {took:.2f} s, timeout_s {T}"
    msg = str(ei.value)
    assert f"backend {hung.name!r}" in msg and "tier 'nvme'" in msg and "tiered.timeout_s" in msg, msg
    assert all(b.closed_ok for b in fast)
    m.close()  # idempotent, even after a failed close


def test_close_with_nothing_hung_still_raises_nothing(tmp_path: Path) -> None:
    m, fast = _manager(tmp_path, DiskBackend(tmp_path / "nvme"))
    m.close()
    assert all(b.closed_ok for b in fast)


def test_closing_backends_after_a_failed_set_up_is_bounded_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fast = _Closing()
    t0 = time.perf_counter()
    _close_backends([("cpu", fast), ("nvme", _HangsOnLoop(tmp_path / "nvme"))], T)
    took = time.perf_counter() - t0
    assert took < _bound(), f"closing after a failed set-up took {took:.2f} s, timeout_s {T}"
    assert fast.closed_ok
    assert "'hang-on-loop' of tier 'nvme'" in caplog.text and "tiered.timeout_s" in caplog.text
