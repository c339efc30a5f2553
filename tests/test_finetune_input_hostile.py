"""`tiered finetune`'s flags and input files, hostile (issue 37, item 1): `--auto-config`'s syntax
checked before the model is built, `--eval-every 0` refused instead of read as --steps, and the
files --config, --data and --eval-data name read only when they are regular files ([Note: files a
user names]): a FIFO no longer hangs the command, /dev/zero no longer fills memory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from finetune_support import ds_config, write_model

from tiered.cli.main import main


def _job(tmp_path: Path, *, config: Path | None = None, data: Path | str | None = None) -> list[str]:
    model = write_model(tmp_path / "m", tokenizer=False)
    if data is None:
        data = tmp_path / "d.txt"
        Path(data).write_text("the fast place is small, the slow place is big. " * 20)
    if config is None:
        config = tmp_path / "ds.json"
        config.write_text(json.dumps(ds_config(tmp_path / "nvme", param="cpu", opt="cpu")))
    return ["finetune", "--model", str(model), "--config", str(config), "--data", str(data),
            "--seq-len", "16", "--steps", "1"]  # fmt: skip


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "step " not in out
    return err


@pytest.mark.parametrize(
    "spec, said",
    [
        ("", "--auto-config: '' holds no key=value pair"),
        (",", "--auto-config: ',' holds no key=value pair"),
        ("cpu_mem=8GB,cpu_mem=16GB", "--auto-config: cpu_mem is given twice (cpu_mem=8GB and cpu_mem=16GB)"),
        ("cpu_mem=", "--auto-config: cpu_mem has no value"),
        ("cpu_memory=8GB", "did you mean cpu_mem?"),
    ],
    ids=["empty", "comma", "twice", "no-value", "misspelt"],
)
def test_auto_config_syntax_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, said: str
) -> None:
    assert said in _refused(capsys, [*_job(tmp_path), "--auto-config", spec])


def test_eval_every_0_is_refused_not_read_as_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(capsys, [*_job(tmp_path), "--eval-fraction", "0.2", "--eval-every", "0"])
    assert "--eval-every must be >= 1" in err


def test_input_files_that_are_no_regular_files_are_refused_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(tmp_path / "fifo")
    fifo = tmp_path / "fifo"
    assert f"--config {fifo}: is a FIFO, not a regular file" in _refused(capsys, _job(tmp_path, config=fifo))
    assert "--config /dev/zero: is a character device" in _refused(
        capsys, _job(tmp_path, config=Path("/dev/zero"))
    )
    assert f"--data {fifo}: is a FIFO, not a regular file" in _refused(capsys, _job(tmp_path, data=fifo))
    assert "--data /dev/zero: is a character device" in _refused(capsys, _job(tmp_path, data="/dev/zero"))
    assert f"{fifo}: is a FIFO" in _refused(capsys, [*_job(tmp_path), "--eval-data", str(fifo)])
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(1 << 30)
    assert f"--config {big}: 1,073,741,824 bytes or more" in _refused(capsys, _job(tmp_path, config=big))
