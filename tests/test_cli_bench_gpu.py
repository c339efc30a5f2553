"""`tiered bench`'s GPU<->CPU link: skipped with a clear reason without CUDA (never a failure),
the PCIe counters read through pynvml (a fake NVML here; the real one in the cuda test)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from tiered.bench.gpu_link import measure_gpu_link, read_pcie
from tiered.cli.main import main

_BASE = [
    "bench",
    "--size",
    "64KiB",
    "--rounds",
    "1",
    "--warmup",
    "0",
    "--no-fio",
    "--no-deepspeed",
    "--quiet",
]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")


@no_cuda
def test_without_cuda_the_section_is_skipped_with_the_reason(tmp_path: Path, capsys) -> None:
    res = measure_gpu_link(1 << 20, rounds=1)
    assert not res.available and res.detail.startswith("no CUDA device:")
    out_json = tmp_path / "b.json"
    assert main([*_BASE, "--dir", str(tmp_path), "--backends", "nvme", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "GPU<->CPU link: skipped: no CUDA device" in out
    doc = json.loads(out_json.read_text())
    assert doc["gpu_link"]["available"] is False and "no CUDA device" in doc["gpu_link"]["detail"]


def test_no_gpu_link_flag_leaves_the_section_out(tmp_path: Path, capsys) -> None:
    assert main([*_BASE, "--dir", str(tmp_path), "--backends", "nvme", "--no-gpu-link"]) == 0
    assert "GPU<->CPU link" not in capsys.readouterr().out


def test_pcie_without_pynvml_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    info = read_pcie(0, lambda: None)
    assert not info.available and "pip install 'tiered[gpu]'" in info.detail


def test_pcie_counters_through_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    fake = types.ModuleType("pynvml")
    fake.NVML_PCIE_UTIL_TX_BYTES, fake.NVML_PCIE_UTIL_RX_BYTES = 0, 1  # type: ignore[attr-defined]
    fake.nvmlInit = lambda: calls.append("init")  # type: ignore[attr-defined]
    fake.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"  # type: ignore[attr-defined]
    fake.nvmlDeviceGetPcieThroughput = lambda h, c: 20_000_000 if c == 0 else 25_000_000  # type: ignore[attr-defined]
    fake.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 5  # type: ignore[attr-defined]
    fake.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 5  # type: ignore[attr-defined]
    fake.nvmlDeviceGetCurrPcieLinkWidth = lambda h: 8  # type: ignore[attr-defined]
    fake.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    ran: list[bool] = []
    info = read_pcie(0, lambda: ran.append(True))
    assert ran == [True] and calls == ["init", "shutdown"]
    assert info.available and (info.generation, info.max_generation, info.width, info.max_width) == (
        5,
        5,
        8,
        16,
    )
    assert info.tx_gbps == pytest.approx(20.0) and info.rx_gbps == pytest.approx(25.0)  # KB/s -> GB/s


def test_nvml_that_cannot_start_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("pynvml")

    def refuse() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    fake.nvmlInit = refuse  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    info = read_pcie(0, lambda: None)
    assert not info.available and "NVML unavailable: NVML Shared Library Not Found" in info.detail


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_link_measures_pinned_and_pageable() -> None:
    res = measure_gpu_link(64 << 20, rounds=2)
    assert res.available, res.detail
    for kind in ("pinned", "pageable"):
        assert res.h2d_gbps[kind] > 0 and res.d2h_gbps[kind] > 0
    assert res.pcie is not None
    text = res.to_markdown()
    assert "| pinned |" in text and "| pageable |" in text
