"""Soak: 1,000 steps of the tiny model with seeded transient faults on every kind of offload I/O
end bitwise equal to the same run without faults; the counts are printed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # the engine tests' helpers

from engine_support import CASES, build, make_batches
from test_faults_training import _config

import tiered

STEPS = 1000
FAULTS = [
    {"kind": "error", "op": "read", "probability": 0.01, "errno": "EAGAIN"},
    {"kind": "error", "op": "write", "probability": 0.01, "errno": "EIO"},
    {"kind": "error", "op": "read", "key": "*.exp_avg_sq", "probability": 0.005, "errno": "EBUSY"},
    {"kind": "torn_write", "mode": "error", "probability": 0.002, "errno": "EINTR"},
]


def _run(tmp_path: Path, faults: list[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, Any], Any]:
    case = CASES["mlp"]
    batches = make_batches(case, 8, 4)
    cfg = _config(tmp_path, {"kind": "delay", "op": "read", "delay_s": 1e-9, "key": "never"})
    cfg["tiered"]["tiers"]["flaky"]["backend"]["faults"] = faults
    cfg["tiered"]["tiers"]["flaky"]["backend"]["seed"] = 1234
    cfg["tiered"]["tiers"]["flaky"]["backend"]["inner"].update(
        fsync=False
    )  # a soak of the logic, not the disk
    cfg["tiered"]["io_retry_backoff_s"] = 0.0
    cfg["tiered"]["io_retries"] = 6
    torch.manual_seed(0)
    with tiered.initialize(build(case), cfg) as engine:
        for i in range(STEPS):
            b = batches[i % len(batches)]
            engine.backward(case.loss(engine(**b)))
            engine.step()
        params = {k: v.detach().clone() for k, v in engine.zero.gather_full_state_dict().items()}
        io = engine.stats()["tiers"]["io"]
        injected = engine.tm.tier("flaky").backend.stats()["injected"]
    return params, io, injected


@pytest.mark.slow
def test_a_thousand_steps_with_transient_faults_end_bitwise_equal(tmp_path: Path) -> None:
    (tmp_path / "clean").mkdir()
    (tmp_path / "faulty").mkdir()
    want, io0, _ = _run(tmp_path / "clean", [])
    got, io, injected = _run(tmp_path / "faulty", FAULTS)
    print(f"\nsoak {STEPS} steps: injected {dict(injected)}; io {io}")
    assert sum(injected.values()) > 0 and io0["retries"] == 0
    assert io["retries"] == sum(injected.values()) and io["gave_up"] == 0, (injected, io)
    assert io["recovered"] >= 1 and io["checksum_failures"] == 0
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
