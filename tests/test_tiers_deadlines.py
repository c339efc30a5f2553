"""`timeout_s` bounds each request as a whole ([Note: one deadline per request]): a hung backend
fails every fetch, prefetch, evict and flush within `timeout_s` (plus a little), however many
inner waits the request has, and the error names the backend, tier, partition and key.

These bound how long a request waits for a hung backend: the bound asserted (1.1 x timeout_s +
0.6 s of scheduling slack) is what the engine promises, not a performance figure; the old code
took 2 x timeout_s in the queued cases."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiers_support import backend, three_tier_manager

from tiered.errors import TierTimeoutError

T = 1.5


def _bound() -> float:
    return 1.1 * T + 0.6


def _timed_error(f: Any) -> tuple[float, str]:
    t0 = time.perf_counter()
    with pytest.raises(TierTimeoutError) as ei:
        f.result(timeout=10 * T)
    return time.perf_counter() - t0, str(ei.value)


def _dirty(m: Any, name: str, tier: str = "cpu") -> Any:
    p = m.create(name, 64, torch.float32, "nvme")
    m.allocate(p, tier).result().fill_(1.0)
    m.mark_dirty(p, tier)
    m.release(p, tier)
    return p


@pytest.mark.parametrize("op", ["evict", "flush"])
def test_write_backs_queued_behind_a_hung_one_fail_within_the_timeout(tmp_path: Path, op: str) -> None:
    # one move at a time on cpu->nvme: the second write-back waits for the link, then for the
    # backend; before, each wait had its own timeout_s and it failed after 2 x timeout_s
    with three_tier_manager(tmp_path, timeout_s=T, max_inflight_per_link=1) as m:
        a, b = _dirty(m, "a"), _dirty(m, "b")
        backend(m, "nvme").faults.delay_s = 1000.0
        t0 = time.perf_counter()
        if op == "evict":
            futs = [m.evict(a, "cpu"), m.evict(b, "cpu")]
        else:
            futs = [m.flush(a), m.flush(b)]
        for f, name in zip(futs, "ab", strict=True):
            _, msg = _timed_error(f)
            took = time.perf_counter() - t0
            assert took < _bound(), f"{op} of {name!r} failed after {took:.2f} s, timeout_s {T}"
            assert f"partition {name!r}" in msg and "tier 'nvme'" in msg
            assert "'test-disk'" in msg and f"key {name!r}" in msg, msg


@pytest.mark.parametrize("second", ["fetch", "prefetch"])
def test_a_request_joining_a_hung_move_fails_in_time_naming_the_hung_backend(
    tmp_path: Path, second: str
) -> None:
    with three_tier_manager(tmp_path, timeout_s=T, max_inflight_per_link=1) as m:
        p = m.create("p", 64, torch.float32, "nvme")
        q = m.create("q", 64, torch.float32, "nvme")
        backend(m, "nvme").faults.delay_s = 1000.0
        t0 = time.perf_counter()
        first = m.prefetch(p, "cpu")  # holds the only nvme->cpu slot, hung
        call: Callable[..., Any] = getattr(m, second)
        queued = call(q, "cpu")  # waits for the link, then hangs itself
        for f, name in ((first, "p"), (queued, "q")):
            _, msg = _timed_error(f)
            took = time.perf_counter() - t0
            assert took < _bound(), f"{second} of {name!r} failed after {took:.2f} s, timeout_s {T}"
            assert f"partition {name!r}" in msg and f"key {name!r}" in msg, msg
            assert "'test-disk'" in msg and "tier 'nvme'" in msg, msg
