"""One run owns its `--out` (issue 37, item 3; [Note: one run per folder]): a second run is refused
at once naming the first's pid, and a `checkpoints` or `final` there that is not a folder is
refused before the model is built, not after the run trained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from finetune_support import ds_config, write_model

from tiered.checkpoint.lock import RunLock
from tiered.cli.main import main
from tiered.errors import RunLockError

ROOT = Path(__file__).resolve().parent.parent


def _job(tmp_path: Path) -> list[str]:
    model = write_model(tmp_path / "m")
    data = tmp_path / "d.txt"
    data.write_text("the fast place is small, the slow place is big. " * 20)
    (tmp_path / "ds.json").write_text(json.dumps(ds_config(tmp_path / "nvme", param="cpu", opt="cpu")))
    return ["finetune", "--model", str(model), "--config", str(tmp_path / "ds.json"), "--data", str(data),
            "--seq-len", "16", "--steps", "1"]  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "plugins"), env.get("PYTHONPATH", "")])
    return env


_HOLDER = """
import sys, time
from tiered.checkpoint.lock import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(300)
"""


def test_a_second_run_on_a_held_out_is_refused_naming_the_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(run)], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and "held" in holder.stdout.readline()
        for extra in ([], ["--resume"], ["--overwrite"]):
            assert main([*_job(tmp_path), "--out", str(run), *extra]) == 2
            out, err = capsys.readouterr()
            assert f"--out {run} is in use by another run (pid {holder.pid} host " in err, err
            assert "step " not in out  # refused before anything trained
        assert sorted(p.name for p in run.iterdir()) == [".run.lock"]  # nothing written beside it
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone (its flock with it): the folder is free again, no stale lock to clear
    assert main([*_job(tmp_path), "--out", str(run)]) == 0, capsys.readouterr().err
    assert (run / "final" / "model.safetensors").is_file()


def test_the_run_lock_is_exclusive_even_within_one_process(tmp_path: Path) -> None:
    with RunLock(str(tmp_path)) as first:
        assert first.held
        with pytest.raises(
            RunLockError, match=rf"--out {tmp_path} is in use by another run \(pid {os.getpid()} "
        ):
            RunLock(str(tmp_path)).acquire()
    RunLock(str(tmp_path)).acquire()  # released with the first


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda p: p.write_text("mine"), "is a regular file"),
        (lambda p: os.mkfifo(p), "is a FIFO"),
        (lambda p: p.symlink_to(p.parent / "nowhere"), "is a symlink to nothing"),
    ],
    ids=["file", "fifo", "dangling-link"],
)
@pytest.mark.parametrize("name", ["final", "checkpoints"])
def test_an_entry_of_the_wrong_kind_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Any, said: str, name: str
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    make(run / name)
    assert main([*_job(tmp_path), "--out", str(run), "--save-every", "1"]) == 2
    out, err = capsys.readouterr()
    assert f"--out {run}: {run / name} {said}, where the run writes" in err, err
    assert "step " not in out and "Traceback" not in err  # before the model was built or trained
    assert os.path.lexists(run / name)  # left as it was


def test_a_linked_final_folder_is_written_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A link to a folder is a folder the user chose: the export goes there."""
    run, elsewhere = tmp_path / "run", tmp_path / "big-disk" / "final"
    run.mkdir()
    elsewhere.mkdir(parents=True)
    (run / "final").symlink_to(elsewhere)
    assert main([*_job(tmp_path), "--out", str(run)]) == 0, capsys.readouterr().err
    assert (elsewhere / "model.safetensors").is_file()
