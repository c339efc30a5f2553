"""Checkpoints are private ([Note: private checkpoints], issue: reliability, item 8): whatever the
umask, a checkpoint's directories are 0700 and its files 0600, as are `latest` and a save_dir
the save creates, also when a tag is saved again; the Hugging Face export keeps the process's
ordinary permissions (it is the deliverable)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkpoint_support import train
from engine_support import CASES, build, ds_config, make_batches

import tiered


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0o022)  # the usual default: files 0644, directories 0755
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("opt", ["cpu", "nvme"])
def test_a_checkpoint_is_owner_only_whatever_the_umask(tmp_path: Path, open_umask: None, opt: str) -> None:
    case = CASES["mlp"]
    save_dir = tmp_path / "runs" / "ck"  # created by the save
    config = ds_config(param="cpu", opt=opt, nvme_path=str(tmp_path / "nvme"))
    with tiered.initialize(build(case), config) as e:
        train(e, case, make_batches(case, 1, 4))
        e.save_checkpoint(save_dir, tag="a", client_state={"epoch": 1})
        train(e, case, make_batches(case, 1, 4, seed=2))
        e.save_checkpoint(save_dir, tag="a")  # the same tag again: swapped in whole
        e.save_checkpoint(save_dir, tag="b")
    assert _mode(save_dir) == 0o700
    assert _mode(save_dir.parent) == 0o755  # only what the save itself created
    entries = list(save_dir.rglob("*"))
    assert {p.name for p in entries} >= {"a", "b", "latest", "manifest.json"}
    for p in entries:
        want = 0o700 if p.is_dir() else 0o600
        assert _mode(p) == want, f"{p.relative_to(save_dir)}: mode {_mode(p):o}, want {want:o}"


def test_an_existing_save_dir_keeps_its_mode_and_the_export_is_ordinary(
    tmp_path: Path, open_umask: None
) -> None:
    case = CASES["mlp"]
    save_dir = tmp_path / "ck"
    save_dir.mkdir(mode=0o750)
    with tiered.initialize(build(case), ds_config(param="cpu", opt="cpu")) as e:
        train(e, case, make_batches(case, 1, 4))
        e.save_checkpoint(save_dir, tag="a")
        e.save_pretrained(tmp_path / "export", dtype=torch.float32)
    assert _mode(save_dir) == 0o750 and _mode(save_dir / "a") == 0o700
    exported = [p for p in (tmp_path / "export").rglob("*") if p.is_file()]
    assert exported and all(_mode(p) == 0o644 for p in exported), {p.name: oct(_mode(p)) for p in exported}
