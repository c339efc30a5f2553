"""`tiered bench`: a live bar on a terminal, plain lines elsewhere; Ctrl-C (a real SIGINT to a
real process) removes every file the benchmark wrote, in bandwidth and in training mode."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiered.bench.progress import BenchProgress, add_total, note

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny-llama"


def test_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    p = BenchProgress(out)
    add_total(p, 2)
    note(p, "size 4 KiB")
    p("round 1/2 nvme: write 1.00 GB/s")
    p.close()
    assert not p.is_bar
    assert out.getvalue() == "  size 4 KiB\n  round 1/2 nvme: write 1.00 GB/s\n"


def test_a_bar_with_the_announced_total_on_a_terminal() -> None:
    pytest.importorskip("tqdm")
    out = io.StringIO()
    p = BenchProgress(out, bar=True)  # as on a terminal
    assert p.is_bar
    add_total(p, 3)
    for i in range(3):
        p(f"step {i + 1}/3: nvme->cpu 1.00 GB/s")
    p.close()
    text = out.getvalue()
    assert "3/3" in text and "nvme->cpu 1.00 GB/s" in text
    assert "  step 1/3" not in text  # no plain lines under the bar


def test_quiet_prints_nothing() -> None:
    out = io.StringIO()
    p = BenchProgress(out, quiet=True, bar=True)
    add_total(p, 1)
    p("x")
    note(p, "y")
    p.close()
    assert out.getvalue() == ""


def _default_sigint() -> None:
    # A child of a non-interactive shell's background job inherits SIGINT ignored, and Python
    # keeps an ignored SIGINT ignored: the interrupt these tests send would never arrive (a CI
    # started as `bash .ci/run &` saw the bench run on and the replay exit 0). As tests/test_signals.py.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "plugins"), env.get("PYTHONPATH", "")])
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def _files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def _interrupt_when(proc: subprocess.Popen[bytes], ready: Path, timeout_s: float = 240.0) -> int:
    """SIGINT to `proc` once `ready` holds a file; its exit status."""
    deadline = time.monotonic() + timeout_s
    while not _files(ready):
        if proc.poll() is not None:
            raise AssertionError(f"the bench ended (rc {proc.returncode}) before writing anything")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the bench wrote nothing in time")
        time.sleep(0.05)
    time.sleep(0.3)  # inside a round, not at its edge
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        # Where it hangs: PYTHONFAULTHANDLER (set by _env) dumps every thread's stack on SIGABRT.
        proc.send_signal(signal.SIGABRT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        tail = err.decode(errors="replace")[-6000:]
        raise AssertionError(f"the bench did not end within 120 s of SIGINT; its threads:\n{tail}") from None


def test_sigint_during_bandwidth_rounds_removes_the_files(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "tiered.cli.main", "bench", "--dir", str(tmp_path), "--size", "16MiB"]
    argv += [
        "--rounds",
        "10000",
        "--warmup",
        "0",
        "--no-fio",
        "--no-deepspeed",
        "--backends",
        "nvme",
        "--quiet",
    ]
    proc = subprocess.Popen(
        argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint
    )
    rc = _interrupt_when(proc, tmp_path)
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert rc == 130, err
    assert "interrupted" in err
    assert list(tmp_path.iterdir()) == [], "Ctrl-C left the benchmark's files"


def test_sigint_during_the_training_replay_removes_the_swap_files(tmp_path: Path) -> None:
    cfg = json.loads((ROOT / "examples" / "ds_config.json").read_text())
    offload = tmp_path / "offload"
    offload.mkdir()
    for k in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][k]["nvme_path"] = str(offload)
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    argv = [sys.executable, "-m", "tiered.cli.main", "bench", "--training", "--model", str(TINY)]
    argv += ["--config", str(tmp_path / "ds.json"), "--steps", "100000", "--quiet"]
    proc = subprocess.Popen(
        argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint
    )
    rc = _interrupt_when(proc, offload)
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert rc == 130, err
    assert list(offload.iterdir()) == [], "Ctrl-C left the replay's swap folder or files"


def test_closing_a_backend_method_cancels_the_move_a_ctrl_c_interrupted(tmp_path: Path) -> None:
    """A Ctrl-C inside the method's run_until_complete leaves its write pending on the loop;
    close() must not resume it (it would write after the delete and the folder's removal)."""
    import asyncio

    from tiered.bench.methods import BackendMethod

    m = BackendMethod("nvme")
    m.setup(tmp_path / "m0", timeout_s=30)
    marker = tmp_path / "resumed"

    async def interrupted_write() -> None:
        await asyncio.sleep(0)  # where the interrupt found it: suspended mid-move
        marker.write_text("the interrupted move ran on")

    assert m.loop is not None
    m.loop.create_task(interrupted_write())  # pending, as a KeyboardInterrupt leaves it
    m.close()
    assert not marker.exists()
    assert not (tmp_path / "m0").exists()
