"""`tiered.timeout_s` through the whole engine, with the faults backend's `hang`: a hung read or
write under a training tier, and a hung close, each end as a TierTimeoutError within timeout_s
(x 1.1, plus scheduling slack) naming the backend, the tier and the key `tiered.timeout_s`
([Note: one deadline per request], [Note: bounded close] in tiered/tiers/waiting.py).

The bound is the feature under test, not a performance figure: before, a hung close was cut only
at 60 s and logged, never raised."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # the engine tests' helpers

from engine_support import CASES, build, faults_tier_config, make_batches

import tiered

T = 1.5
SLACK_S = 1.0  # the rest of the call that meets the hang: a tiny model's compute, thread hand-offs


def _config(tmp_path: Path, fault: dict[str, Any]) -> dict[str, Any]:
    return faults_tier_config(tmp_path, fault, timeout_s=T)


def _train_until_timeout(cfg: dict[str, Any], steps: int = 3) -> tuple[Any, BaseException | None, float]:
    """initialize, then train until a call raises TierTimeoutError: (the engine or None, that
    error, how long that call took)."""
    case = CASES["mlp"]
    state: dict[str, Any] = {}
    calls = [lambda: state.__setitem__("engine", tiered.initialize(build(case), cfg))]
    for b in make_batches(case, steps, 4):
        calls += [
            lambda b=b: state.__setitem__("loss", case.loss(state["engine"](**b))),
            lambda: state["engine"].backward(state["loss"]),
            lambda: state["engine"].step(),
        ]
    calls.append(lambda: state["engine"].tm.flush().result())  # a write-back still in flight
    for call in calls:
        t0 = time.perf_counter()
        try:
            call()
        except tiered.TierTimeoutError as e:
            return state.get("engine"), e, time.perf_counter() - t0
    return state["engine"], None, 0.0


@pytest.mark.parametrize(
    "fault",
    [
        {"kind": "hang", "op": "read", "key": "*.param", "after": 4, "nth": 1},
        {"kind": "hang", "op": "read", "key": "*.exp_avg", "nth": 1},
        {"kind": "hang", "op": "write", "key": "*.param", "nth": 1},
        {"kind": "hang", "op": "write", "key": "*.param", "after": 4, "nth": 1},  # 4 groups: past init
        {"kind": "hang", "op": "write", "key": "*.exp_avg_sq", "after": 4, "nth": 1},
    ],
    ids=["fetch", "prefetch", "create", "flush", "evict"],  # the wait each one meets (today)
)
def test_a_hung_read_or_write_fails_its_call_within_the_timeout(
    tmp_path: Path, fault: dict[str, Any]
) -> None:
    engine, err, took = _train_until_timeout(_config(tmp_path, fault))
    if engine is not None:
        try:
            engine.close(restore_weights=False)
        except tiered.TierTimeoutError:
            pass
    assert err is not None, "the hang never surfaced"
    assert took < 1.1 * T + SLACK_S, f"the call that met the hang took {took:.2f} s, timeout_s {T}"
    msg = str(err)
    assert "'faults'" in msg and "tier 'flaky'" in msg and "partition '" in msg, msg
    assert "tiered.timeout_s" in msg, msg


def test_a_hung_close_fails_within_the_timeout_naming_backend_tier_and_key(tmp_path: Path) -> None:
    engine, err, _ = _train_until_timeout(_config(tmp_path, {"kind": "hang", "op": "close"}), steps=1)
    assert err is None
    t0 = time.perf_counter()
    with pytest.raises(tiered.TierTimeoutError) as ei:
        engine.close()
    took = time.perf_counter() - t0
    assert took < 1.1 * T + SLACK_S, f"close took {took:.2f} s, timeout_s {T}"
    msg = str(ei.value)
    assert "backend 'faults' of tier 'flaky'" in msg and "tiered.timeout_s" in msg, msg
    assert list((tmp_path / "nvme").iterdir()) == [], "the other tiers' swap folders were not removed"
    assert all(p.numel() > 0 for p in engine.module.parameters()), "the trained weights were not given back"
