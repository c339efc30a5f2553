"""Full disk (issue: reliability, item 5): the pre-flight free-space check is exact on a real
filesystem of exactly the size a run takes (a tmpfs mounted for the test: root only), and a disk
that fills up during a step is a clear error that leaves the tier's files intact, after which
the run, with space freed, trains again."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import CASES, build, ds_config, make_batches

import tiered
from tiered.errors import CapacityError, StorageIOError

PAGE = os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def tmpfs(where: Path, size: int) -> Iterator[Path]:
    """A tmpfs of `size` bytes (a multiple of the page size) mounted on `where`, unmounted after.
    tmpfs charges whole pages per file and nothing for directories, so `size` is all there is."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs of an exact size needs root")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (no CAP_SYS_ADMIN?): {done.stderr.strip()}")
    try:
        st = os.statvfs(where)
        assert st.f_blocks * st.f_frsize == size, "tmpfs did not take the exact size asked for"
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


PLACEMENTS = {
    # fp32, params and optimizer state both on nvme: the master *is* the parameter (3 fp32 files)
    "fp32-all-nvme": {"param": "nvme", "opt": "nvme"},
    # params in cpu: the master is a file of its own next to exp_avg / exp_avg_sq
    "fp32-optimizer-nvme": {"param": "cpu", "opt": "nvme"},
}


def _train(eng: Any, steps: int = 2, seed: int = 1) -> Any:
    case = CASES["mlp"]
    for b in make_batches(case, steps, 4, seed=seed):
        eng.backward(case.loss(eng(**b)))
        eng.step()
    return eng


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_disk_of_exactly_the_size_needed_trains_and_one_page_less_is_refused_up_front(
    tmp_path: Path, placement: str
) -> None:
    # what a run really occupies, measured on a roomy tmpfs at the end of training (in-place swap
    # files never grow after their first write, so the end is the peak)
    with tmpfs(tmp_path / "big", 64 << 20) as big:
        cfg = ds_config(nvme_path=str(big), **PLACEMENTS[placement])
        eng = _train(tiered.initialize(build(CASES["mlp"]), cfg))
        need = _used(big)
        ref = {k: v.clone() for k, v in eng.state_dict_fp32().items()}
        eng.close()
        assert _used(big) == 0, "close() left swap files on the disk"
    assert need % PAGE == 0 and need > 4 * PAGE

    with tmpfs(tmp_path / "exact", need) as exact:  # exactly that much: it must train
        eng = _train(
            tiered.initialize(build(CASES["mlp"]), ds_config(nvme_path=str(exact), **PLACEMENTS[placement]))
        )
        try:
            assert _used(exact) == need
            got = eng.state_dict_fp32()
            for k, v in ref.items():
                assert torch.equal(got[k], v), k
        finally:
            eng.close()

    smaller = need - PAGE
    with tmpfs(tmp_path / "small", smaller) as small:  # one page less: refused before training
        with pytest.raises(CapacityError) as info:
            tiered.initialize(build(CASES["mlp"]), ds_config(nvme_path=str(small), **PLACEMENTS[placement]))
        msg = str(info.value)
        assert "not enough free space" in msg and str(small) in msg, msg
        still = int(re.search(r"still writes (\d+) bytes", msg)[1])  # type: ignore[index]
        free = int(re.search(r"only (\d+) bytes", msg)[1])  # type: ignore[index]
        # what the check counts is what the run takes: it is short by exactly the page removed
        assert still - free == PAGE, f"the check is off by {still - free - PAGE} bytes: {msg}"
        assert _used(small) == 0, "a refused initialize left files behind"


def _fill(path: Path) -> Path:
    """Take every free byte of the filesystem at `path` (a real ENOSPC for whoever writes next)."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * PAGE)
    assert os.statvfs(path).f_bavail == 0
    return filler


def _tier_cfg(spec: dict[str, Any]) -> dict[str, Any]:
    """Optimizer state in a user-declared tier (atomic writes: a temp file per write-back)."""
    cfg = ds_config(param="cpu", opt="cpu")
    # residency off: each step writes the state back (the subject), not kept in cpu until a flush
    cfg["tiered"] = {"tiers": {"mine": {"backend": spec}}, "optimizer_tier": "mine", "residency": "off"}
    return cfg


def _files(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in d.iterdir()}


FULL_DISKS = ["tmpfs", "faults"]


@pytest.mark.parametrize("disk", FULL_DISKS)
def test_a_disk_that_fills_up_during_training_is_a_clear_error_and_flush_then_step_goes_on(
    tmp_path: Path, disk: str
) -> None:
    """`tmpfs`: a real filesystem filled to the last byte between steps (root); `faults`: the
    faults plugin's ENOSPC on every write-back of step 2 (anyone), then no more."""
    case = CASES["mlp"]
    batches = make_batches(case, 5, 4)
    ref = tiered.initialize(build(case), ds_config(param="cpu", opt="cpu"))
    _train(ref, 5)
    want = ref.state_dict_fp32()
    ref.close()

    with contextlib.ExitStack() as stack:
        if disk == "tmpfs":
            root = stack.enter_context(tmpfs(tmp_path / "disk", 4 << 20))
            (root / "mine").mkdir()
            spec: dict[str, Any] = {"type": "nvme", "path": str(root / "mine")}
        else:
            (tmp_path / "mine").mkdir()
            root = tmp_path
            n = 3 * 4  # 4 groups x 3 state files written back per step
            spec = {
                "type": "faults",
                "inner": {"type": "nvme", "path": str(tmp_path / "mine")},
                "faults": [
                    {
                        "kind": "error",
                        "op": "write",
                        "errno": "ENOSPC",
                        "after": 2 * n,  # initialize and step 1
                        "max_fires": n,  # every write-back of step 2, then the disk has room
                    }
                ],
            }
        eng = tiered.initialize(build(case), _tier_cfg(spec))
        try:
            eng.backward(case.loss(eng(**batches[0])))
            eng.step()
            eng.flush()
            at_rest = _files(root / "mine")
            filler = _fill(root) if disk == "tmpfs" else None
            with pytest.raises(StorageIOError) as info:  # at the latest when the next step starts
                for b in batches[1:3]:
                    eng.backward(case.loss(eng(**b)))
                    eng.step()
            msg = str(info.value)
            assert info.value.errno == errno.ENOSPC, msg
            assert "partition 'g0" in msg and "->mine" in msg, msg
            assert disk == "faults" or str(root / "mine") in msg, msg  # (faults fail before any file)
            assert "Free space there, call engine.flush()" in msg and "engine.step() again" in msg, msg
            # the tier's directory is consistent: the same files, whole, and no temp file left
            assert _files(root / "mine") == at_rest
            if filler is not None:
                filler.unlink()  # space freed
            eng.flush()  # writes the copies the failed write-backs left dirty in memory
            eng.step()  # the step that raised had done nothing: it runs now
            for b in batches[3:]:
                eng.backward(case.loss(eng(**b)))
                eng.step()
            got = eng.state_dict_fp32()
            assert eng.global_steps == 5
        finally:
            eng.close()
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{k} differs from the run that never met a full disk"
