"""benchmarks/moe_replica.py end to end at a toy size: a per-expert bf16 folder written as
transformers writes it, the search in a fresh process, from_pretrained with the chosen config
(streamed into pieces), the steps, and the report of the load's peak against the fused tensor.
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
SCRIPT = ROOT / "benchmarks" / "moe_replica.py"


@pytest.mark.slow
def test_toy_moe_replica_plans_streams_trains_and_reports(tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    argv = [sys.executable, str(SCRIPT), "--dir", str(tmp_path), "--layers", "1", "--hidden", "128"]
    argv += ["--inter", "256", "--experts", "8", "--heads", "4", "--kv-heads", "2", "--vocab", "512"]
    argv += ["--seq", "16", "--steps", "2", "--gpu-mem", "1GiB", "--cpu-mem", "2GiB", "--json", str(out_json)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")])}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out_json.read_text())
    assert doc["fits"] and doc["shape"]["fused_numel"] == 8 * 512 * 128
    m = doc["measured"]
    assert len(m["losses"]) == 2 and all(x == x for x in m["losses"])
    assert 0 < m["rss_before_load"] <= m["load_peak_rss"] <= m["rss"]
    assert (
        "largest fused tensor (experts.gate_up_proj" in proc.stdout
        and "peak RSS while loading" in proc.stdout
    )
    assert list(tmp_path.iterdir()) == [out_json]  # the weights and the swap are removed
