"""The checkpoint format: streamed safetensors files, checksums, atomic publication, `latest`,
half-written checkpoints, a disk that fills up, and a save killed at random points."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tiered.checkpoint import directory, find_latest_valid, load_tensors, read_latest, save_tensors, stream
from tiered.checkpoint.stream import StreamWriter, TensorSpec
from tiered.errors import CheckpointCorruptError, CheckpointNotFoundError, CheckpointSpaceError, TieredError

HERE = Path(__file__).parent


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(1000, generator=g),
        "ids": torch.arange(10, dtype=torch.int64).reshape(2, 5),
        "half": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(5, generator=g).to(torch.float16),
        "empty": torch.empty(0),
        "rng": torch.get_rng_state(),
    }


def test_streamed_file_loads_with_safe_open(tmp_path: Path) -> None:
    t = _tensors()
    # 100-byte chunks: every tensor arrives in many appends
    path = save_tensors(tmp_path, "s1", t, chunk_bytes=100)
    with safe_open(os.path.join(path, "tensors.safetensors"), "pt") as f:
        assert set(f.keys()) == set(t)
        for k, v in t.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k
        assert torch.equal(f.get_slice("w")[10:20], t["w"][10:20])
    assert read_latest(tmp_path) == "s1"
    _, manifest, loaded = load_tensors(tmp_path)
    assert manifest["tag"] == "s1" and all(torch.equal(loaded[k], v) for k, v in t.items())
    assert sorted(os.listdir(tmp_path)) == [".lock", "latest", "s1"]  # no staging or temp file left


def test_stream_writer_refuses_wrong_bytes(tmp_path: Path) -> None:
    specs = [TensorSpec("a", torch.float32, (4,)), TensorSpec("b", torch.float32, (2,))]
    w = StreamWriter(str(tmp_path / "f.safetensors"), specs)
    with pytest.raises(ValueError, match="overruns tensor 'a'"):
        w.append(torch.zeros(5))
    with pytest.raises(ValueError, match="tensor 'a' is torch.float32"):
        w.append(torch.zeros(4, dtype=torch.float64))
    w.append(torch.zeros(4))
    with pytest.raises(ValueError, match="tensor 'b' is incomplete"):
        w.finish()
    w.close()


def test_checksum_mismatch_names_the_file(tmp_path: Path) -> None:
    path = save_tensors(tmp_path, "s1", _tensors())
    f = os.path.join(path, "tensors.safetensors")
    with open(f, "r+b") as fh:  # flip one byte of tensor data, size unchanged
        fh.seek(-20, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-20, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CheckpointCorruptError, match="tensors.safetensors fails its checksum"):
        load_tensors(tmp_path)
    assert find_latest_valid(tmp_path) is None
    assert find_latest_valid(tmp_path, verify=False) == "s1"  # sizes alone cannot see it


def test_half_written_checkpoint_is_never_latest_and_an_error_when_named(tmp_path: Path) -> None:
    save_tensors(tmp_path, "global_step1", _tensors(1), {"counters": {"global_steps": 1}})
    os.makedirs(directory.staging_path(str(tmp_path), "global_step2"))  # a save killed midway
    (tmp_path / "global_step3").mkdir()  # a directory without manifest
    (tmp_path / "global_step3" / "tensors.safetensors").write_bytes(b"junk")
    assert read_latest(tmp_path) == "global_step1"
    assert find_latest_valid(tmp_path) == "global_step1"
    with pytest.raises(CheckpointCorruptError, match="never completed"):
        load_tensors(tmp_path, "global_step2")
    with pytest.raises(CheckpointCorruptError, match="has no manifest.json"):
        load_tensors(tmp_path, "global_step3")
    with pytest.raises(CheckpointNotFoundError, match="global_step9 does not exist"):
        load_tensors(tmp_path, "global_step9")


def test_latest_naming_a_missing_tag_is_an_error_naming_it(tmp_path: Path) -> None:
    save_tensors(tmp_path, "a", _tensors(1), {"counters": {"global_steps": 1}})
    save_tensors(tmp_path, "b", _tensors(2), {"counters": {"global_steps": 2}})
    (tmp_path / "latest").write_text("gone")
    with pytest.raises(CheckpointNotFoundError, match=r"names tag 'gone'.*newest complete one is 'b'"):
        load_tensors(tmp_path)
    os.remove(tmp_path / "latest")
    with pytest.raises(CheckpointNotFoundError, match="no 'latest' file.*'b'"):
        load_tensors(tmp_path)
    assert load_tensors(tmp_path, "a")[1]["tag"] == "a"


def test_saving_an_existing_tag_replaces_it_whole(tmp_path: Path) -> None:
    save_tensors(tmp_path, "s", _tensors(1))
    save_tensors(tmp_path, "s", {"only": torch.ones(3)})
    _, _, t = load_tensors(tmp_path, "s")
    assert list(t) == ["only"]
    assert sorted(os.listdir(tmp_path)) == [".lock", "latest", "s"]


@pytest.mark.parametrize("fail_after", [0, 5000, 40_000])
def test_disk_full_mid_write_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_after: int
) -> None:
    save_tensors(tmp_path, "good", _tensors(1))
    real = stream._raw_write
    written = [0]

    def filling(fd: int, data: memoryview) -> int:
        if written[0] + len(data) > fail_after:
            raise OSError(errno.ENOSPC, "No space left on device")
        written[0] += len(data)
        return real(fd, data)

    monkeypatch.setattr(stream, "_raw_write", filling)
    big = {"x": torch.randn(20_000)}
    with pytest.raises(
        CheckpointSpaceError,
        match=r"no space left on device while writing checkpoint file .*"
        r"\.bad\.partial/tensors\.safetensors",
    ) as ei:
        save_tensors(tmp_path, "bad", big, chunk_bytes=4096)
    assert (
        isinstance(ei.value, OSError) and isinstance(ei.value, TieredError) and ei.value.errno == errno.ENOSPC
    )
    assert read_latest(tmp_path) == "good"
    assert sorted(os.listdir(tmp_path)) == [".lock", "good", "latest"]  # the staging directory is gone
    _, _, t = load_tensors(tmp_path)
    assert torch.equal(t["w"], _tensors(1)["w"])


def test_free_space_is_checked_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_tensors(tmp_path, "good", _tensors(1))
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(directory.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(CheckpointSpaceError, match=r"it needs 80\d\d\d bytes .* 1000 bytes are free"):
        save_tensors(tmp_path, "next", {"x": torch.zeros(20_000)})
    assert sorted(os.listdir(tmp_path)) == [".lock", "good", "latest"]


def _expected(step: int) -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(HERE))
    try:
        from checkpoint_kill_worker import tensors_for
    finally:
        sys.path.pop(0)
    return tensors_for(step)


def test_kill_9_at_random_points_leaves_the_previous_checkpoint_latest_and_valid(tmp_path: Path) -> None:
    rnd = random.Random(1234)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    next_step, kills = 0, 0
    for _ in range(5):
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "checkpoint_kill_worker.py"), str(tmp_path), str(next_step)],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # one save completed: kill somewhere in the following ones
        assert first.strip() == str(next_step), first
        time.sleep(rnd.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read()
        proc.wait()
        kills += proc.returncode == -signal.SIGKILL
        printed = [int(x) for x in [first, *rest.split()] if str(x).strip()]
        last = printed[-1]
        latest = read_latest(tmp_path)
        # the save after the last printed one may have completed just before the kill
        assert latest in (f"step{last}", f"step{last + 1}"), (latest, printed)
        step = int(latest.removeprefix("step"))
        # a kill between the rename into place and the move of `latest` leaves one newer complete
        # checkpoint that `latest` does not name yet: never an incomplete one
        assert find_latest_valid(tmp_path) in (latest, f"step{step + 1}")
        path, manifest, t = load_tensors(tmp_path)  # every file verified against its checksum
        assert manifest["counters"]["global_steps"] == step
        want = _expected(step)
        assert set(t) == set(want) and all(torch.equal(t[k], want[k]) for k in want)
        for s in printed:  # every completed save is still there and whole
            assert (tmp_path / f"step{s}" / "manifest.json").is_file()
        next_step = step + 1
    assert kills == 5
