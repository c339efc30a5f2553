"""The GPU<->CPU link of `tiered bench`: host-to-device and device-to-host copies from pinned
and from pageable host memory, and the PCIe counters NVML reports while they run.

[Note: GPU link measurement]
The pinned and the pageable buffer are timed round-robin (one H2D and one D2H each per round,
the order rotated, [Note: round-robin measurement]), with CUDA events around each copy on a side
stream, median over the rounds after one warm-up round. Pinned copies are what tiered's "cpu"
tier gives the "gpu" tier (the cpu backend pins where CUDA exists); pageable copies are what a
``"pin_memory": false`` config gets (the driver stages them through its own pinned buffer).
Where pynvml imports (``pip install 'tiered[gpu]'``: the nvidia-ml-py package), the PCIe link's
current and maximum generation and width are read, and its TX/RX throughput counters
(``nvmlDeviceGetPcieThroughput``, KB/s over a 20 ms window) are sampled during a pinned copy
loop, so a copy rate far below what the link negotiated is visible. Without a CUDA device the
section is skipped with the reason (never an error): CPU-only hosts run everything else.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tiered.units import format_bytes


@dataclass(frozen=True)
class PcieInfo:
    available: bool
    detail: str = ""
    generation: int | None = None
    max_generation: int | None = None
    width: int | None = None
    max_width: int | None = None
    tx_gbps: float | None = None
    """Peak NVML TX (device to host) throughput sampled during the copies, GB/s."""
    rx_gbps: float | None = None


@dataclass(frozen=True)
class GpuLinkResult:
    available: bool
    detail: str
    """Why the section was skipped, or the device's name."""
    size_bytes: int = 0
    rounds: int = 0
    h2d_gbps: dict[str, float] = field(default_factory=dict)
    """"pinned" / "pageable" -> median GB/s host to device."""
    d2h_gbps: dict[str, float] = field(default_factory=dict)
    pcie: PcieInfo | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def to_markdown(self) -> str:
        if not self.available:
            return f"GPU<->CPU link: skipped: {self.detail}\n"
        lines = [
            f"GPU<->CPU link on {self.detail}: {format_bytes(self.size_bytes, binary=True)} copies, "
            f"{self.rounds} round-robin rounds after 1 warm-up, median (CUDA events)",
            "",
            "| host memory | host->device GB/s | device->host GB/s |",
            "|---|---|---|",
        ]
        for kind in ("pinned", "pageable"):
            lines.append(f"| {kind} | {self.h2d_gbps.get(kind, 0):.2f} | {self.d2h_gbps.get(kind, 0):.2f} |")
        p = self.pcie
        if p is not None and p.available:
            tx = "-" if p.tx_gbps is None else f"{p.tx_gbps:.2f}"
            rx = "-" if p.rx_gbps is None else f"{p.rx_gbps:.2f}"
            lines += [
                "",
                f"PCIe (NVML): gen {p.generation} (max {p.max_generation}) x{p.width} (max x{p.max_width}); "
                f"counters during the pinned copies: TX {tx} GB/s, RX {rx} GB/s",
            ]
        elif p is not None:
            lines += ["", f"PCIe counters: {p.detail}"]
        return "\n".join(lines) + "\n"


def cuda_missing_reason() -> str:
    """Why there is no CUDA device to measure, or "" when there is one."""
    if torch.version.cuda is None:
        return f"no CUDA device: this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False (no GPU visible, or no driver)"
    return ""


def measure_gpu_link(size_bytes: int = 256 << 20, rounds: int = 5, device: int = 0) -> GpuLinkResult:
    """Pinned and pageable H2D / D2H GB/s and the PCIe counters; skipped without CUDA."""
    why = cuda_missing_reason()
    if why:
        return GpuLinkResult(False, why)
    dev = torch.device("cuda", device)
    gpu = torch.empty(size_bytes, dtype=torch.uint8, device=dev)
    hosts = {
        "pinned": torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True),
        "pageable": torch.empty(size_bytes, dtype=torch.uint8),
    }
    stream = torch.cuda.Stream(dev)
    h2d: dict[str, list[float]] = {k: [] for k in hosts}
    d2h: dict[str, list[float]] = {k: [] for k in hosts}
    kinds = list(hosts)
    for r in range(rounds + 1):
        order = kinds[r % 2 :] + kinds[: r % 2]
        for kind in order:
            up = _timed_copy(gpu, hosts[kind], stream)
            down = _timed_copy(hosts[kind], gpu, stream)
            if r:  # round 0 warms the driver's staging buffers and the caching allocator
                h2d[kind].append(size_bytes / up / 1e9)
                d2h[kind].append(size_bytes / down / 1e9)
    pcie = read_pcie(device, lambda: _copy_loop(gpu, hosts["pinned"], stream, seconds=0.5))
    return GpuLinkResult(
        True,
        torch.cuda.get_device_name(dev),
        size_bytes,
        rounds,
        {k: statistics.median(v) for k, v in h2d.items()},
        {k: statistics.median(v) for k, v in d2h.items()},
        pcie,
    )


def _timed_copy(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


def _copy_loop(gpu: torch.Tensor, host: torch.Tensor, stream: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _timed_copy(gpu, host, stream)
        _timed_copy(host, gpu, stream)


def read_pcie(device: int, load: Any) -> PcieInfo:
    """The link's generation and width, and the TX/RX counters' peak while `load()` runs."""
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return PcieInfo(False, "pynvml not installed: pip install 'tiered[gpu]' (nvidia-ml-py) for them")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVML absent or refusing: report why, measure the rest
        return PcieInfo(False, f"NVML unavailable: {exc}")
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(device)
        samples: dict[str, list[int]] = {"tx": [], "rx": []}
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples["tx"].append(pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES))
                samples["rx"].append(pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES))

        t = threading.Thread(target=sample, name="tiered-bench-nvml", daemon=True)
        t.start()
        try:
            load()
        finally:
            stop.set()
            t.join(timeout=5)
        kb = 1e3 / 1e9  # NVML reports KB/s
        return PcieInfo(
            True,
            "",
            pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
            pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h),
            pynvml.nvmlDeviceGetCurrPcieLinkWidth(h),
            pynvml.nvmlDeviceGetMaxPcieLinkWidth(h),
            max(samples["tx"]) * kb if samples["tx"] else None,
            max(samples["rx"]) * kb if samples["rx"] else None,
        )
    except Exception as exc:  # noqa: BLE001 - a counter this GPU or driver lacks: say which
        return PcieInfo(False, f"NVML PCIe query failed: {type(exc).__name__}: {exc}")
    finally:
        pynvml.nvmlShutdown()
