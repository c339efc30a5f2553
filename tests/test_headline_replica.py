"""benchmarks/headline_replica.py end to end at a toy size (its memories given, since the
headline's scaled by 1/20000 hold less than the process itself): the search in a fresh process,
from_pretrained with the chosen config, the steps, and the report of plan against measured.
Not timed: the figures are the benchmark's (benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "headline_replica.py"


@pytest.mark.slow  # ~10 s or more on two cores: the default run stays under 15 minutes
def test_toy_replica_plans_trains_and_reports_plan_against_measured(tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    argv = [sys.executable, str(SCRIPT), "--dir", str(tmp_path), "--scale", "20000", "--hidden", "128"]
    argv += ["--seq", "16", "--steps", "2", "--gpu-mem", "1GiB", "--cpu-mem", "4GiB", "--json", str(out_json)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")])}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out_json.read_text())
    assert doc["fits"] and doc["memories"]["gpu"] == 1 << 30 and doc["memories"]["cpu"] == 4 << 30
    shape = doc["shape"]
    assert shape["hidden"] == 128 and shape["heads"] == 1 and shape["vocab"] == round(128256 / 64)
    measured, plan = doc["measured"], doc["plan"]
    assert len(measured["losses"]) == 2 and all(x == x for x in measured["losses"])
    assert measured["rss"] > 0 and plan["peaks"]["device"] + plan["peaks"]["host"] > 0
    assert "measured peak RSS" in proc.stdout and "x the plan's GPU + host" in proc.stdout
    assert "predicted" in proc.stdout
    if sys.platform == "linux":  # VmHWM read after loading, reset, read after the steps
        assert (
            0 < measured["load_peak_rss"] <= measured["rss"]
            and 0 < measured["steps_peak_rss"] <= measured["rss"]
        )
        assert "loading" in proc.stdout
    assert list(tmp_path.iterdir()) == [out_json]  # the weights and the swap are removed
