"""`tiered bench` bad input checked before anything is written or allocated: a drive without
space for the sizes (bytes needed said, the sweep's largest size first), a size larger than RAM
or than a memory tier, and a file system without O_DIRECT (the fallback said once)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch

import tiered.bench.preflight as pf
from tiered.cli.main import main
from tiered.storage import Capabilities, Capacity, StorageBackend, register_backend, unregister_backend

MIB = 1 << 20
_BASE = ["bench", "--rounds", "1", "--warmup", "0", "--no-fio", "--no-deepspeed", "--quiet"]


class TinyDeviceStore(StorageBackend):
    """A memory-like tier on a device with 1 MiB free (a small GPU, here a fake)."""

    name = "tinydevice"
    static_capabilities = Capabilities(persistent=False, memory_like=True, device="cuda")

    def __init__(self) -> None:
        self._data: dict[str, torch.Tensor] = {}

    async def write(self, key: str, tensor: torch.Tensor) -> None:
        self._data[key] = tensor.clone()

    async def read(self, key: str, out: torch.Tensor) -> None:
        out.copy_(self._data[key])

    async def delete(self, key: str) -> None:
        del self._data[key]

    async def exists(self, key: str) -> bool:
        return key in self._data

    def capacity(self) -> Capacity:
        return Capacity(total_bytes=MIB, free_bytes=MIB)


@pytest.fixture
def tinydevice():
    register_backend("tinydevice", TinyDeviceStore)
    yield
    unregister_backend("tinydevice")


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("tiered bench: error:") and len(err.splitlines()) == 1, err
    return err


def test_no_space_is_checked_first_with_the_bytes_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(pf, "free_bytes", lambda path: 10 * MIB)
    assert main([*_BASE, "--dir", str(tmp_path), "--size", "64MiB", "--backends", "nvme"]) == 2
    err = _err(capsys)
    assert "10.49 MB free" in err and f"({2 * 64 * MIB} bytes" in err and "smaller --size" in err
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_checks_its_largest_size_before_measuring_any(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tiered.bench.sweep as sw

    monkeypatch.setattr(pf, "free_bytes", lambda path: 8 * MIB)  # 4 KiB .. 1 MiB would fit
    measured: list[int] = []
    monkeypatch.setattr(sw, "run_bandwidth", lambda opts, progress=None: measured.append(opts.size_bytes))
    argv = [*_BASE, "--dir", str(tmp_path), "--sweep", "--max-size", "16MiB", "--backends", "nvme"]
    assert main(argv) == 2
    assert f"({2 * 16 * MIB} bytes" in _err(capsys)
    assert measured == []


def test_a_size_larger_than_ram_for_a_memory_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(pf, "available_ram_bytes", lambda: 150 * MIB)
    # two bench buffers fit (128 MiB), the cpu tier's copy does not (192 MiB)
    assert main([*_BASE, "--dir", str(tmp_path), "--size", "64MiB", "--backends", "cpu"]) == 2
    err = _err(capsys)
    assert "memory tier cpu" in err and f"({3 * 64 * MIB} bytes)" in err and "157.29 MB is available" in err
    assert list(tmp_path.iterdir()) == []


def test_a_size_larger_than_a_device_memory_tier(
    tmp_path: Path, tinydevice: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*_BASE, "--dir", str(tmp_path), "--size", "4MiB", "--backends", "tinydevice"]) == 2
    err = _err(capsys)
    assert "larger than the 1.05 MB free in memory tier 'tinydevice' (cuda)" in err
    assert main([*_BASE, "--dir", str(tmp_path), "--size", "512KiB", "--backends", "tinydevice"]) == 0


def test_a_file_system_without_o_direct_falls_back_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capsys
) -> None:
    real_open = os.open
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        pytest.skip("no O_DIRECT on this platform")

    def no_direct(path, flags, *args, **kwargs):  # as tmpfs on older kernels, FUSE, some NFS
        if flags & direct:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="tiered.bench.methods"):
        argv = [*_BASE, "--dir", str(tmp_path), "--sweep", "--max-size", "64KiB", "--backends", "cpu"]
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(O_DIRECT refused: buffered)" in out
    said = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]  # three sizes, said once
    assert list(tmp_path.iterdir()) == []
