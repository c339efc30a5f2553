"""kill -9 and SIGTERM at seeded random moments of TRAINING (issue: reliability, item 6), then
`tiered finetune --resume`: each run goes on from the last complete checkpoint, and after
several kills the run ends bit for bit equal to one that was never interrupted. (Kills during
checkpoint saves: tests/test_checkpoint_format.py with checkpoint_kill_worker.py.) Slow: six
runs of the CLI."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_finetune_checkpoints as runs
from finetune_support import assert_bitwise_equal, final_weights

from tiered.cli.main import main

STEPS = 16
job = runs.job  # the fixture: a tiny model folder, data and a config with params on nvme


def _latest_step(out: Path) -> int:
    latest = out / "checkpoints" / "latest"
    if not latest.exists():
        return 0
    return int(latest.read_text().strip().removeprefix("global_step"))


@pytest.mark.slow
def test_kills_at_random_moments_of_training_then_resume_end_bitwise_equal(
    tmp_path: Path, job: list[str]
) -> None:
    rng = random.Random(14)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    base = [sys.executable, "-m", "tiered.cli.main", *job, "--steps", str(STEPS), "--out", str(parts)]
    base += ["--save-every", "3"]
    history = []
    kinds = [signal.SIGKILL, signal.SIGTERM, signal.SIGKILL, signal.SIGTERM, signal.SIGKILL]
    rng.shuffle(kinds)
    for sig in kinds:
        before = _latest_step(parts)
        if before >= STEPS - 1:  # saved at the last step a kill could wait for: nothing left to interrupt
            break
        cmd = base + (["--resume"] if before else [])
        at_step = rng.randint(before + 1, min(before + 4, STEPS - 1))  # a step line to wait for
        delay = rng.uniform(0.0, 0.2)  # then somewhere inside the next step (or its save)
        proc = subprocess.Popen(
            cmd, env=runs._env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(f"step {at_step:5d}/"):
                time.sleep(delay)
                proc.send_signal(sig)
                break
        rest, err = proc.communicate(timeout=300)
        text = "".join(seen) + rest
        if before:
            first = next(ln for ln in text.splitlines() if ln.startswith("step "))
            assert first.startswith(f"step {before + 1:5d}/"), f"not resumed from step {before}: {text}"
        want_rc = -signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGTERM
        assert proc.returncode == want_rc, f"{signal.Signals(sig).name}: {proc.returncode}\n{err[-3000:]}"
        after = _latest_step(parts)
        assert after >= before, "a kill lost a complete checkpoint"
        if sig == signal.SIGTERM:  # it finished the step, saved it and exited
            assert after >= at_step, text
        history.append((signal.Signals(sig).name, at_step, round(delay, 3), before, after))
    assert any(h[0] == "SIGKILL" and h[3] > 0 for h in history), history  # a kill -9 after a save
    assert main([*job, "--steps", str(STEPS), "--out", str(parts), "--save-every", "3", "--resume"]) == 0
    assert main([*job, "--steps", str(STEPS), "--out", str(whole), "--save-every", "3"]) == 0
    print("kills (signal, at step, delay s, checkpoint before, after):", history)
    assert_bitwise_equal(final_weights(parts), final_weights(whole))
    nvme = tmp_path / "nvme"
    assert not [p for p in nvme.iterdir() if p.name.startswith("tiered-swap-")], "a swap folder was left"
