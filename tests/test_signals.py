"""SIGTERM and kill -9 outside the CLI (issue: reliability, item 6): a Python-API script that gets
SIGTERM removes its swap folder and ends as killed by SIGTERM; tiered touches SIGTERM only where
it has its default disposition, from the main thread, and gives it back at close; the swap
folder a kill -9 leaves is reclaimed by the next run with a WARNING. See [Note: SIGTERM from a
library]."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from engine_support import CASES, build, ds_config

import tiered
from tiered.engine.signals import sigterm_handled

_TRAINS_FOREVER = """
import sys, signal
sys.path.insert(0, {tests!r})
import torch, tiered
from engine_support import MLP, ds_config
stop = []
if {own_handler!r}:
    signal.signal(signal.SIGTERM, lambda *a: stop.append(print("own handler", flush=True)))
engine = tiered.initialize(MLP(), ds_config(param="nvme", opt="nvme", nvme_path={nvme!r}))
while not stop:
    engine.backward(engine(x=torch.randn(4, 16), y=torch.randn(4, 8)))
    engine.step()
    print("step", engine.global_steps, flush=True)
engine.close()
sys.exit(7)
"""


def _default_sigint() -> None:
    # A child of a non-interactive shell's background job inherits SIGINT ignored, and Python
    # then installs no KeyboardInterrupt handler: give the script the terminal's default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(tmp_path: Path, *, own_handler: bool = False) -> tuple[subprocess.Popen[str], Path]:
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    code = _TRAINS_FOREVER.format(tests=str(Path(__file__).parent), nvme=str(nvme), own_handler=own_handler)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"},
        preexec_fn=_default_sigint,
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # training has begun: the swap folder holds files
        if line.startswith("step 2"):
            break
    else:
        proc.wait(timeout=30)
        pytest.fail(f"the script never trained: {proc.stderr.read() if proc.stderr else ''}")
    assert [p.name for p in nvme.iterdir() if p.name.startswith("tiered-swap-")], "no swap folder"
    return proc, nvme


def test_sigterm_to_a_python_api_script_removes_its_swap_folder_and_ends_as_killed(tmp_path: Path) -> None:
    proc, nvme = _start(tmp_path)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # seen once in a full CI run: keep every thread's stack
        proc.send_signal(signal.SIGABRT)  # faulthandler prints them
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the script hung after SIGTERM; its threads:\n{err[-8000:]}")
    assert proc.returncode == -signal.SIGTERM, err[-3000:]  # as a process killed by SIGTERM ends
    assert "SIGTERM: closing 1 tiered engine" in err, err[-3000:]
    assert list(nvme.iterdir()) == [], "SIGTERM left the swap folder behind"


_BLOCKED_IN_LOGGING = """
import logging, sys, time
sys.path.insert(0, {tests!r})
import torch, tiered
from engine_support import MLP, ds_config

class StuckStderr(logging.StreamHandler):
    # a stderr pipe nobody drains: the write blocks while this handler's lock is held
    def emit(self, record):
        if record.getMessage() == "stuck":
            print("stuck", flush=True)
            time.sleep(300)
        super().emit(record)

logging.getLogger().addHandler(StuckStderr(sys.stderr))
logging.getLogger().setLevel(logging.DEBUG)  # the tier manager's loop thread logs as it closes
engine = tiered.initialize(MLP(), ds_config(param="nvme", opt="nvme", nvme_path={nvme!r}))
for _ in range(2):
    engine.backward(engine(x=torch.randn(4, 16), y=torch.randn(4, 8)))
    engine.step()
logging.getLogger("script").warning("stuck")
"""


def test_sigterm_while_the_main_thread_holds_a_lock_the_close_needs_still_ends_the_process(
    tmp_path: Path,
) -> None:
    """The handler runs where the main thread was: here inside a logging handler whose write is
    stuck, holding the lock the loop thread needs to log while it closes. The close waited
    tiered.timeout_s (600 s) for that thread; now it is bounded ([Note: SIGTERM from a
    library]) and the process ends as killed by SIGTERM."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    code = _BLOCKED_IN_LOGGING.format(tests=str(Path(__file__).parent), nvme=str(nvme))
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("stuck"):
            break
    else:
        proc.wait(timeout=30)
        pytest.fail(f"the script never reached its stuck write: {proc.stderr.read() if proc.stderr else ''}")
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("SIGTERM did not end a process whose main thread held a lock the close needs")
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
    assert "did not close within" in err, err[-3000:]  # said, not silent


@pytest.mark.parametrize("seed", range(3))
def test_ctrl_c_at_a_random_moment_ends_a_python_api_script_promptly_and_removes_its_swap(
    tmp_path: Path, seed: int
) -> None:
    """A real SIGINT lands wherever the script is (forward, a backward hook, the step, a wait on
    the tier manager): KeyboardInterrupt unwinds, the engine left open closes at exit, the
    process ends as interrupted within a bounded time and the swap folder is gone."""
    proc, nvme = _start(tmp_path)
    time.sleep(random.Random(seed).uniform(0.05, 1.0))
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("Ctrl-C did not end the script within 60 s")
    assert proc.returncode == -signal.SIGINT, err[-3000:]  # Python re-raises an unhandled SIGINT
    assert "KeyboardInterrupt" in err, err[-3000:]
    assert list(nvme.iterdir()) == [], "Ctrl-C left the swap folder behind"


def test_a_program_s_own_sigterm_handler_is_left_alone(tmp_path: Path) -> None:
    proc, nvme = _start(tmp_path, own_handler=True)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert "own handler" in out and proc.returncode == 7, err[-3000:]
    assert "SIGTERM: closing" not in err
    assert list(nvme.iterdir()) == []


def test_the_handler_is_installed_only_over_the_default_and_given_back_at_close() -> None:
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the test runner changed SIGTERM"
    first = tiered.initialize(build(CASES["mlp"]), ds_config())
    second = tiered.initialize(build(CASES["mlp"]), ds_config())
    assert sigterm_handled()
    first.close()
    assert sigterm_handled(), "closing one engine of two gave SIGTERM back while the other is open"
    second.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def own(signum: int, frame: object) -> None: ...

    previous = signal.signal(signal.SIGTERM, own)
    try:
        eng = tiered.initialize(build(CASES["mlp"]), ds_config())
        assert signal.getsignal(signal.SIGTERM) is own
        eng.close()
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_engine_made_off_the_main_thread_leaves_sigterm_alone() -> None:
    made: list[tiered.Engine] = []
    t = threading.Thread(target=lambda: made.append(tiered.initialize(build(CASES["mlp"]), ds_config())))
    t.start()
    t.join(timeout=60)
    try:
        assert made and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        for e in made:
            e.close()


def test_the_swap_folder_of_a_kill_9_is_reclaimed_by_the_next_run_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc, nvme = _start(tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    left = [p for p in nvme.iterdir() if p.name.startswith("tiered-swap-")]
    assert len(left) == 1 and any(left[0].iterdir()), "kill -9 should leave its swap folder"
    time.sleep(0.1)
    caplog.set_level(logging.INFO)
    eng = tiered.initialize(build(CASES["mlp"]), ds_config(param="nvme", opt="nvme", nvme_path=str(nvme)))
    try:
        warned = [r for r in caplog.records if "stale swap" in r.getMessage()]
        assert warned and all(r.levelno == logging.WARNING for r in warned), caplog.text
        assert left[0].name in warned[0].getMessage() and "freed" in warned[0].getMessage()
        assert not left[0].exists()
    finally:
        eng.close()
