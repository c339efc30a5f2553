"""Faults injected under a training tier: a transient read error is retried and counted, a lasting
one reaches the user as a storage error naming the backend and the partition, a failed prefetch is
read again, a hang becomes a timeout."""

from __future__ import annotations

import errno
import fnmatch
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # the engine tests' helpers

from engine_support import (
    CASES,
    REL,
    assert_losses_close,
    assert_params_close,
    build,
    faults_tier_config,
    make_batches,
    reference_train,
)

import tiered
from tiered.errors import StorageIOError


def _config(tmp_path: Path, fault: dict[str, Any]) -> dict[str, Any]:
    return faults_tier_config(tmp_path, fault)


def test_a_transient_read_error_is_retried_and_counted(tmp_path: Path) -> None:
    # one read of a parameter in the first step's forward, with an errno a retry cures
    fault = {"kind": "error", "op": "read", "key": "*.param", "after": 4, "nth": 1, "errno": "EAGAIN"}
    case = CASES["mlp"]
    batches = make_batches(case, 4, 4)
    want_losses, want = reference_train(build(case), case, batches)
    got_losses = []
    with tiered.initialize(build(case), _config(tmp_path, fault)) as engine:
        for b in batches:
            loss = case.loss(engine(**b))
            got_losses.append(float(loss.detach()))
            engine.backward(loss)
            engine.step()
        got = {k: v.detach().float().clone() for k, v in engine.zero.gather_full_state_dict().items()}
        io = engine.stats()["tiers"]["io"]
        assert engine.tm.tier("flaky").backend.stats()["injected"]["error"] == 1  # the fault did hit
    assert io["retries"] == 1 and io["recovered"] == 1 and io["gave_up"] == 0, io
    assert_losses_close(got_losses, want_losses)
    assert_params_close(got, want, REL)


@pytest.mark.parametrize(
    "fault",
    [
        # optimizer state that can no longer be read: retried (EIO is in the transient class), then reported
        {"kind": "error", "op": "read", "key": "*.exp_avg_sq", "errno": "EIO"},
        # an errno outside the transient class reaches the user at once
        {"kind": "error", "op": "read", "key": "*.param", "after": 4, "nth": 1, "errno": "EACCES"},
    ],
    ids=["persistent-EIO", "non-transient-EACCES"],
)
def test_an_injected_read_error_reaches_the_user_naming_backend_and_partition(tmp_path: Path, fault) -> None:
    case = CASES["mlp"]
    engine = tiered.initialize(build(case), _config(tmp_path, fault))
    flaky = engine.tm.tier("flaky").backend
    with pytest.raises(StorageIOError) as info:
        with engine:
            for b in make_batches(case, 4, 4):
                loss = case.loss(engine(**b))
                engine.backward(loss)
                engine.step()
    msg = str(info.value)
    assert isinstance(info.value, OSError)
    assert "backend 'faults'" in msg and "injected E" in msg and "faults[0]" in msg, msg
    name = msg.split("partition '", 1)[1].split("'", 1)[0]
    assert f"key {name!r}" in msg and fnmatch.fnmatchcase(name, fault["key"]), msg
    assert flaky.stats()["injected"]["error"] >= 1
    causes, exc = [], info.value  # the errno the fault chose is on the error's cause chain
    while exc is not None:
        causes.append(getattr(exc, "errno", None))
        exc = exc.__cause__
    assert getattr(errno, fault["errno"]) in causes, causes


def test_a_failed_state_prefetch_is_read_again_and_training_stays_exact(tmp_path: Path) -> None:
    # the optimizer prefetches states during backward; the step fetches them again if that failed
    fault = {"kind": "error", "op": "read", "key": "g0000.exp_avg_sq", "nth": 2, "errno": "EAGAIN"}
    case = CASES["mlp"]
    batches = make_batches(case, 3, 4)
    want_losses, want = reference_train(build(case), case, batches)
    got_losses = []
    with tiered.initialize(build(case), _config(tmp_path, fault)) as engine:
        for b in batches:
            loss = case.loss(engine(**b))
            got_losses.append(float(loss.detach()))
            engine.backward(loss)
            engine.step()
        got = {k: v.detach().float().clone() for k, v in engine.zero.gather_full_state_dict().items()}
        assert engine.tm.tier("flaky").backend.stats()["injected"]["error"] == 1  # the fault did hit
    assert_losses_close(got_losses, want_losses)
    assert_params_close(got, want, REL)


def test_a_hung_read_becomes_a_timeout_naming_partition_tier_and_backend(tmp_path: Path) -> None:
    cfg = _config(tmp_path, {"kind": "hang", "op": "read", "key": "*.param", "after": 4, "nth": 1})
    cfg["tiered"]["timeout_s"] = 2
    case = CASES["mlp"]
    t0 = time.perf_counter()
    with pytest.raises(
        tiered.TierTimeoutError, match=r"partition 'g\d+\.param' in tier 'flaky' \(backend 'faults'"
    ):
        with tiered.initialize(build(case), cfg) as engine:
            for b in make_batches(case, 2, 4):
                engine.backward(case.loss(engine(**b)))
                engine.step()
    assert time.perf_counter() - t0 < 30, "the hang outlived the 2 s timeout by far (close included)"
