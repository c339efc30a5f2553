"""Integrity, bounded waits and retries under training, proven with injected faults: a flipped
bit or a torn file in an offload tier is caught before training uses it, a hung backend is a
timeout within the byte-scaled bound, a transient error is retried and counted."""

from __future__ import annotations

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
    make_batches,
    reference_train,
)
from test_faults_training import _config

import tiered
from tiered.errors import StorageCorruptError, TierTimeoutError
from tiered.storage import open_backend
from tiered.storage.bridge import IOBridge


def _train(engine: Any, batches: list[dict[str, Any]], losses: list[float] | None = None) -> None:
    """Train on `batches`; `engine.steps_done` counts the steps that returned."""
    case = CASES["mlp"]
    for b in batches:
        loss = case.loss(engine(**b))
        if losses is not None:
            losses.append(float(loss.detach()))
        engine.backward(loss)
        engine.step()
        engine.steps_done = getattr(engine, "steps_done", 0) + 1


def _reread_params(engine: Any) -> None:
    """Finish the write-backs, then drop the memory copies of the parameters (as memory pressure
    would), so the next forward reads them from the offload tier again."""
    engine.flush()
    for p in engine.tm.partitions():
        if p.name.endswith(".param"):
            for t in ("gpu", "cpu"):
                if t in p.copies() and p.state(t).readable:
                    engine.tm.evict(p, t).result()


def _flip_one_bit(path: Path, offset: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("suffix", ["param", "exp_avg_sq"])
def test_a_bit_flipped_on_disk_between_steps_is_caught_and_named(tmp_path: Path, suffix: str) -> None:
    case = CASES["mlp"]
    engine = tiered.initialize(
        build(case), _config(tmp_path, {"kind": "delay", "op": "read", "delay_s": 1e-6})
    )
    batches = make_batches(case, 3, 4)
    with pytest.raises(StorageCorruptError) as info:
        with engine:
            _train(engine, batches[:1])
            _reread_params(engine)
            files = sorted((tmp_path / "flaky").glob(f"*.{suffix}"))
            assert files, list((tmp_path / "flaky").iterdir())
            victim = files[0]
            _flip_one_bit(victim)  # a bad sector, between steps
            _train(engine, batches[1:])
    msg = str(info.value)
    part = victim.name
    assert f"partition {part!r}" in msg and "tier 'flaky'" in msg and "backend 'faults'" in msg, msg
    assert str(victim) in msg and "xxh3_64" in msg and "read" in msg and "written" in msg, msg
    assert engine.steps_done == 1, "a step completed on the corrupt bytes"
    io = engine.tm.stats()["io"]
    assert io["checksum_failures"] >= 1 and io["verified_bytes"] > 0, io


@pytest.mark.parametrize("key", ["g0000.param", "g0001.exp_avg_sq"])
def test_a_bitflip_fault_on_a_write_is_caught_before_training_uses_it(tmp_path: Path, key: str) -> None:
    # the 2nd write of the key is its write-back after step 1: the stored copy is corrupt for good
    fault = {"kind": "bitflip", "op": "write", "key": key, "nth": 2}
    case = CASES["mlp"]
    engine = tiered.initialize(build(case), _config(tmp_path, fault))
    batches = make_batches(case, 3, 4)
    with pytest.raises(StorageCorruptError, match=rf"partition {key!r} in tier 'flaky'.*checksum mismatch"):
        with engine:
            _train(engine, batches[:1])
            _reread_params(engine)
            _train(engine, batches[1:])
    assert engine.tm.tier("flaky").backend.stats()["injected"]["bitflip"] == 1
    assert engine.steps_done == 1


def test_a_torn_optimizer_state_write_is_a_corruption_error_not_api_advice(tmp_path: Path) -> None:
    fault = {"kind": "torn_write", "key": "g0000.exp_avg_sq", "nth": 2, "mode": "silent"}
    case = CASES["mlp"]
    engine = tiered.initialize(build(case), _config(tmp_path, fault))
    with pytest.raises(StorageCorruptError) as info:
        with engine:
            _train(engine, make_batches(case, 3, 4))
    msg = str(info.value)
    assert "g0000.exp_avg_sq" in msg and "truncated" in msg and "tier 'flaky'" in msg, msg
    assert str(tmp_path / "flaky" / "g0000.exp_avg_sq") in msg, msg
    assert "pass a tensor of exactly" not in msg, msg
    assert engine.steps_done == 1
    assert engine.tm.stats()["io"]["truncated"] >= 1  # the prefetch in backward, then the step


def test_a_hung_backend_is_a_timeout_within_the_floor_and_close_is_bounded(tmp_path: Path) -> None:
    cfg = _config(tmp_path, {"kind": "hang", "op": "read", "key": "*.param", "after": 4, "nth": 1})
    cfg["tiered"]["io_timeout_floor_s"] = 1.0  # timeout_s stays at its 600 s default
    case = CASES["mlp"]
    t0 = time.perf_counter()
    with pytest.raises(TierTimeoutError) as info:
        with tiered.initialize(build(case), cfg) as engine:
            _train(engine, make_batches(case, 2, 4))
    took = time.perf_counter() - t0
    msg = str(info.value)
    assert "tier 'flaky' (backend 'faults'" in msg and "io_timeout_floor_s" in msg, msg
    name = msg.split("partition '", 1)[1].split("'", 1)[0]
    assert name.endswith(".param") and f"key {name!r}" in msg, msg
    assert took < 20, f"hang + close took {took:.1f} s for a 1 s bound"
    assert engine.tm.stats()["io"]["timeouts"] >= 1


def test_a_transient_error_is_retried_counted_and_training_stays_exact(tmp_path: Path) -> None:
    fault = {"kind": "error", "op": "any", "key": "*.param", "probability": 0.2, "errno": "EAGAIN"}
    case = CASES["mlp"]
    batches = make_batches(case, 3, 4)
    want_losses, want = reference_train(build(case), case, batches)
    cfg = _config(tmp_path, fault)
    cfg["tiered"]["io_retries"] = 8
    got_losses: list[float] = []
    with tiered.initialize(build(case), cfg) as engine:
        _train(engine, batches, got_losses)
        got = {k: v.detach().float().clone() for k, v in engine.zero.gather_full_state_dict().items()}
        io = engine.stats()["tiers"]["io"]
        injected = engine.tm.tier("flaky").backend.stats()["injected"]["error"]
    assert injected >= 1 and io["retries"] == injected and io["recovered"] >= 1 and io["gave_up"] == 0, io
    assert_losses_close(got_losses, want_losses)
    assert_params_close(got, want, REL)


def test_checksums_can_be_turned_off(tmp_path: Path) -> None:
    cfg = _config(tmp_path, {"kind": "delay", "op": "read", "delay_s": 1e-6})
    cfg["tiered"]["verify_checksums"] = False
    case = CASES["mlp"]
    with tiered.initialize(build(case), cfg) as engine:
        _train(engine, make_batches(case, 1, 4))
        assert engine.tm.stats()["io"]["verified_reads"] == 0


@pytest.mark.parametrize(
    "spec",
    [
        lambda p: {"type": "faults", "inner": {"type": "nvme", "path": str(p / "a")}},
        lambda p: {"type": "stripe", "paths": [str(p / "a"), str(p / "b")]},
        lambda p: {"type": "faults", "inner": {"type": "stripe", "paths": [str(p / "a")]}},
    ],
    ids=["faults", "stripe", "faults-over-stripe"],
)
def test_wrappers_forward_the_bridge_to_their_inner_backends(tmp_path: Path, spec: Any) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    bridge = IOBridge(2)
    try:
        b = open_backend(spec(tmp_path), bridge=bridge)
        leaves, todo = [], [b]
        while todo:
            x = todo.pop()
            inner = [getattr(x, "inner", None), *getattr(x, "members", ())]
            inner = [i for i in inner if i is not None]
            todo += inner
            if not inner:
                leaves.append(x)
        assert len(leaves) >= 1 and all(leaf.bridge is bridge for leaf in leaves), leaves
        b.use_bridge(None)  # and back to the default: every leaf follows
        assert all(leaf.bridge is not bridge for leaf in leaves), leaves
    finally:
        bridge.close()
