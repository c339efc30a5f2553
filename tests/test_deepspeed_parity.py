"""The probe list (tests/deepspeed_probe.py) on tiered's engine and on DeepSpeed's CPU engine, live,
over the same model, JSON and data: each "value" call returns the same. Skipped where DeepSpeed is
not installed (it is no dependency of tiered); DeepSpeed runs in its own process (its import sets up
its CPU accelerator and world)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import deepspeed_probe as probe
import pytest
from deepspeed_examples_env import deepspeed_installed
from engine_support import no_leftover_process_group  # noqa: F401 - the fixture
from test_deepspeed_surface import same

import tiered.deepspeed as deepspeed

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.slow,
    pytest.mark.usefixtures("no_leftover_process_group"),
    pytest.mark.skipif(not deepspeed_installed(), reason="DeepSpeed is not installed"),
]


def test_each_call_returns_what_deepspeed_returns(tmp_path: Any) -> None:
    out = tmp_path / "deepspeed.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    subprocess.run(
        [sys.executable, str(Path(probe.__file__)), "--deepspeed", "--json", str(out)],
        check=True,
        env=env,
        timeout=1800,
        cwd=tmp_path,
    )
    theirs = json.loads(out.read_text())
    (tmp_path / "tiered").mkdir()
    ours = probe.run_probes(deepspeed, str(tmp_path / "tiered"))
    assert {n for n, r in ours.items() if not r["ok"]} == set()
    assert {n for n, r in theirs.items() if not r["ok"]} == set()
    diffs = [
        d
        for n, r in ours.items()
        if probe.kind_of(n) == "value"
        for d in same(r["value"], theirs[n]["value"], n)
    ]
    assert not diffs, diffs
