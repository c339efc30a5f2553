"""The memory promise (issue 37): for a config the engine accepts, the process's peak RSS stays
within its promised host peak (``stats()["host_memory"]["planned_peak_bytes"]``, plus the
activations where the compute runs on the CPU: [Note: compute memory on a CPU-only machine]),
and a config `auto_config` chose for some host memory never takes more than that memory. A 136M
Llama, parameters and Adam state homed on NVMe, each run in a process of its own (ru_maxrss)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _run(*args: str) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(HERE / "memory_promise_child.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "residency"), [("fp32", "off"), ("bf16", "off"), ("fp32", "auto")])
def test_peak_rss_stays_within_the_engines_promise(dtype: str, residency: str) -> None:
    r = _run(dtype, residency)
    assert r["rss"] <= 1.10 * (r["planned"] + r["activations"]), r


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "cpu_mem"), [("fp32", 2_600_000_000)])
def test_the_config_chosen_for_some_host_memory_keeps_the_engines_promise(dtype: str, cpu_mem: int) -> None:
    """On this machine the "gpu" tier is host memory too: the search counts it, and the
    parameters the live budget keeps gathered there, in the host figure, and the engine's promise
    for the config it chose is what the process peaks at (within 10 %).

    Not claimed here: that the peak stays within `cpu_mem` itself. It does in an environment whose
    packages were installed a while before (2.52 GB for the 2.6 GB given, this tree and the one
    before this round alike), but not in a freshly installed one: the clean clone's own virtual
    environment peaked at 2.62-2.65 GB for the same config, with this round's code and the
    previous round's (bf16 at 2.0 GB: 2.03 GB there). The process baseline the memory model
    counts is a constant measured once; why a fresh install's process holds ~0.1 GB more is not
    found yet. Left open in issue 37 (item 7)."""
    r = _run(dtype, "auto", str(cpu_mem))
    assert r["rss"] <= 1.10 * (r["planned"] + r["activations"]), r
