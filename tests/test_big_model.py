"""benchmarks/big_model.py (the scaled replica of issue 11) at a few million parameters, through
the same code path as the >= 2B run: streamed weights, training on NVMe tiers, checkpoint, resume
in a fresh process, export, the report's fields; its files are removed, also when it is stopped.
Not timed: the figures themselves are the benchmark's (benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "big_model.py"
SMALL = [
    "--params", "3e6", "--layers", "2", "--vocab", "1024", "--seq", "32",
    "--gpu-frac", "0.6", "--cpu-frac", "0.6", "--bw-size", str(16 << 20),
]  # fmt: skip


def _run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")])}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.slow  # 35 s: CI runs it in ./dev.sh slow
def test_small_replica_trains_resumes_exports_and_reports(tmp_path):
    work = tmp_path / "disk"
    work.mkdir()
    out = tmp_path / "report.json"
    res = _run(["--dir", str(work), *SMALL, "--json", str(out)])
    assert res.returncode == 0, res.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["params"] > 1_000_000 and r["training_state_bytes"] == 16 * r["params"]
    assert r["budgets"]["gpu"] == int(0.6 * r["training_state_bytes"])
    assert len(r["steps_s"]) == 3 and r["step_s"] > 0
    # everything is homed on NVMe: each step reads and writes it, gradients included
    links = r["links_per_step"]
    assert links["nvme->cpu"]["bytes"] > 0 and links["cpu->nvme"]["bytes"] > 0
    # exp_avg and exp_avg_sq at least: the overlapped step consumes the gradient from memory
    # ([Note: gradient consumed from memory] in tiered/optim/group.py) and max_in_cpu may keep
    # new parameters in cpu instead of writing them ([Note: max_in_cpu])
    assert r["nvme_write_bytes_per_step"] >= 4 * r["params"] * 2
    assert r["raw_read_gbps"] > 0 and r["raw_write_gbps"] > 0 and r["layer_fwd_bwd_s"] > 0
    assert (
        r["bound_s"] == max(r["compute_s"], r["io_s"]) and r["ratio_to_bound"] == r["step_s"] / r["bound_s"]
    )
    for phase in (
        "weights",
        "load",
        "train",
        "checkpoint",
        "reference_step",
        "resume_load",
        "resume_step",
        "export",
    ):
        assert r["peak_rss"][phase] > 0, phase
    assert r["peak_rss_max"] == max(r["peak_rss"].values())
    # the resumed engine (another process) took the same step bit for bit; the export is complete
    assert r["resume_loss_equal"] and r["resume_params_equal"]
    assert r["export"]["tensors"] == 2 * 9 + 3 and r["checkpoint_bytes"] >= 12 * r["params"]
    assert "ratio" in res.stdout and "peak RSS" in res.stdout
    assert list(work.iterdir()) == []  # the work directory is gone


@pytest.mark.slow  # 21 s: CI runs it in ./dev.sh slow
def test_stopped_run_removes_its_files_and_its_engine_process(tmp_path):
    work = tmp_path / "disk"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")])}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--dir", str(work), *SMALL, "--steps", "50"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        spec = None
        while time.monotonic() < deadline and spec is None:  # the engine process has started
            spec = next(work.glob("tiered-big-*/train.spec.json"), None)
            time.sleep(0.2)
        assert spec is not None, "the train phase never started"
        swap = spec.parent / "swap"
        while time.monotonic() < deadline and not any(swap.rglob("*")):  # it is writing its swap
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # as `timeout` does; Ctrl-C takes the same path
        assert proc.wait(timeout=180) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert list(work.iterdir()) == []
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(spec) not in ps  # no engine process left behind


def test_too_little_disk_is_refused_before_anything_is_written(tmp_path):
    res = _run(["--dir", str(tmp_path), "--params", "5e12", "--layers", "4"], timeout=300)
    assert res.returncode != 0
    assert "GB free" in res.stderr and "--params" in res.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # 25 s: CI runs it in ./dev.sh slow
def test_bf16_and_accumulation_reach_the_engine_and_move_the_formulas_bytes(tmp_path):
    """Issue 22 item 2 asks the replica's bytes against the formula in bf16 mixed precision and
    with accumulation: --precision and --accumulation must be what the engine ran (its formula
    is computed from the engine's own config, so it says which), and the bytes it moved must be
    the formula's. At this toy size the tiers hold 60% of the state each: a partition still
    resident when it is next needed is neither read nor written back, so the bytes may fall under
    the formula (6-7% of the writes with two micro-batches here), never above it by over 5%."""
    work = tmp_path / "disk"
    work.mkdir()
    reports = {}
    for precision, accumulation in (("fp32", 1), ("bf16", 2)):
        out = tmp_path / f"{precision}_{accumulation}.json"
        res = _run(
            [
                "--dir",
                str(work),
                *SMALL,
                "--train-only",
                "--steps",
                "2",
                "--precision",
                precision,
                "--accumulation",
                str(accumulation),
                "--json",
                str(out),
            ]  # fmt: skip
        )
        assert res.returncode == 0, res.stderr[-4000:]
        reports[precision] = json.loads(out.read_text())
    exact, mixed = reports["fp32"], reports["bf16"]
    assert (mixed["precision"], mixed["accumulation"]) == ("bf16", 2)
    assert mixed["tokens_per_step"] == 2 * exact["tokens_per_step"]
    # two micro-batches: the gradient waits for the second one at home (written and read back),
    # and bf16 keeps an fp32 master beside its compute copy: the formula says both
    assert mixed["formula_per_step"]["host->disk"] > 1.3 * exact["formula_per_step"]["host->disk"]
    assert mixed["losses"] != exact["losses"]  # other data (two micro-batches), other precision
    for r in (exact, mixed):
        formula = r["formula_per_step"]
        assert 0.85 <= r["nvme_write_bytes_per_step"] / formula["host->disk"] <= 1.05
        assert 0.75 <= r["nvme_read_bytes_per_step"] / formula["disk->host"] <= 1.05
    assert list(work.iterdir()) == []
