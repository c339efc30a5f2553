"""`tiered bench --sweep`: the round-robin measurement over transfer sizes, a table and a plot.

Each size is one `run_bandwidth` (its own warm-up and rounds, every method round-robin at that
size, [Note: round-robin measurement]), so a figure at 4 KiB and one at 1 GiB are each medians of
the same number of rounds. The spread is the fastest and slowest round, as GB/s.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered.bench.preflight import check_free_space, check_memory
from tiered.bench.progress import note
from tiered.bench.runner import BenchOptions, BenchResult, MethodResult, run_bandwidth
from tiered.errors import ConfigError
from tiered.units import format_bytes

MIN_SWEEP = 4096


def sweep_sizes(max_bytes: int, *, factor: int = 4) -> list[int]:
    """4 KiB, 16 KiB, ... up to and including `max_bytes` (rounded down to 4 KiB)."""
    if max_bytes < MIN_SWEEP:
        raise ConfigError(f"--max-size: {max_bytes} B is below the {MIN_SWEEP} B smallest transfer")
    sizes, n = [], MIN_SWEEP
    while n < max_bytes:
        sizes.append(n)
        n *= factor
    sizes.append(max_bytes // MIN_SWEEP * MIN_SWEEP)
    return sizes


def spread_gbps(size: int, seconds: tuple[float, ...]) -> tuple[float, float] | None:
    """(slowest, fastest) round in GB/s."""
    return (size / max(seconds) / 1e9, size / min(seconds) / 1e9) if seconds else None


@dataclass(frozen=True)
class SweepResult:
    runs: tuple[BenchResult, ...]

    def to_json(self) -> dict[str, Any]:
        out = []
        for run in self.runs:
            doc = run.to_json()
            for m, j in zip(run.methods, doc["methods"], strict=True):
                j["write_spread_gbps"] = spread_gbps(run.size_bytes, m.write_s)
                j["read_spread_gbps"] = spread_gbps(run.size_bytes, m.read_s)
            out.append(doc)
        return {"sweep": out}

    def series(self) -> dict[tuple[str, str], list[tuple[int, float]]]:
        """(method, "write"/"read") -> [(size, median GB/s)] for the methods measured."""
        found: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for run in self.runs:
            for m in run.methods:
                for direction, gbps in (("write", m.write_gbps), ("read", m.read_gbps)):
                    if gbps is not None:
                        found.setdefault((m.name, direction), []).append((run.size_bytes, gbps))
        return found

    def to_markdown(self) -> str:
        lines = [
            "| size | method | write GB/s (min-max) | read GB/s (min-max) | status |",
            "|---|---|---|---|---|",
        ]
        for run in self.runs:
            for m in run.methods:
                if m.status == "absent":
                    continue
                lines.append(
                    f"| {format_bytes(run.size_bytes, binary=True)} | {m.name} | "
                    f"{_cell(m.write_gbps, spread_gbps(run.size_bytes, m.write_s))} | "
                    f"{_cell(m.read_gbps, spread_gbps(run.size_bytes, m.read_s))} | {_status(m)} |"
                )
        return "\n".join(lines) + "\n"

    def plot(self, path: Path) -> None:
        """GB/s vs transfer size per method and direction (log-log), the ceiling drawn bold."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ConfigError(f"--plot needs matplotlib: pip install 'tiered[bench]' ({exc})") from exc
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        ceiling = self.runs[0].methods[0].name if self.runs and self.runs[0].methods else None
        for ax, direction in zip(axes, ("write", "read"), strict=True):
            for (name, d), points in sorted(self.series().items()):
                if d != direction:
                    continue
                xs, ys = zip(*points, strict=True)
                style: dict[str, Any] = (
                    {"linewidth": 3, "color": "black"} if name == ceiling else {"marker": "o"}
                )
                ax.plot(xs, ys, label=name + (" (ceiling)" if name == ceiling else ""), **style)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("transfer size (bytes)")
            ax.set_title(direction)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("GB/s (median)")
        axes[1].legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def _cell(gbps: float | None, spread: tuple[float, float] | None) -> str:
    if gbps is None:
        return "-"
    return f"{gbps:.2f}" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else "")


def _status(m: MethodResult) -> str:
    s = m.status if not m.detail else f"{m.status}: {m.detail}"
    return s + (" (read possibly cached)" if m.possibly_cached else "")


def run_sweep(
    opts: BenchOptions, max_bytes: int, progress: Callable[[str], None] | None = None
) -> SweepResult:
    sizes = sweep_sizes(max_bytes)
    # the largest size is checked before the smallest is measured: a sweep that cannot finish
    # must not run for minutes first
    biggest = dataclasses.replace(opts, size_bytes=sizes[-1]).aligned_size
    if Path(opts.directory).is_dir():
        check_free_space(
            Path(opts.directory), 2 * biggest, "the largest transfer, written and kept until checked"
        )
    check_memory(biggest, [{"type": n} for n in opts.backends] + [dict(s) for s in opts.specs])
    runs = []
    for size in sizes:
        note(progress, f"size {format_bytes(size, binary=True)}")
        runs.append(run_bandwidth(dataclasses.replace(opts, size_bytes=size), progress=progress))
    return SweepResult(tuple(runs))


def median_gbps(result: SweepResult, method: str, direction: str) -> float | None:
    points = result.series().get((method, direction), [])
    return statistics.median(g for _s, g in points) if points else None
