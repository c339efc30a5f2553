"""`tiered bench --tune`: the nvme knobs swept on a model's training pattern, the best written
as a config fragment.

Each setting (block size x queue depth x thread count, DeepSpeed's `aio` meanings, [Note:
DeepSpeed aio knobs] in the nvme backend) replays the training pattern ([Note: training I/O
pattern]) through a tier manager opened with that setting: one warm-up step and one measured step
per round, settings rotated round-robin over the rounds ([Note: round-robin measurement]); the
score is the median I/O seconds per step summed over the storage links (lower is better: it is
the time a step spends moving bytes). The fragment holds the best setting twice, as the `aio`
block a DeepSpeed config carries and as the tiered keys of each nvme tier
(``tiered.tiers.<tier>.backend``), so it merges into either kind of config.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered.bench.progress import add_total
from tiered.bench.training import TrainingBenchResult, bench_training
from tiered.errors import ConfigError
from tiered.units import format_bytes

if TYPE_CHECKING:
    from torch import nn

    from tiered.config.schema import TieredConfig

KIB, MIB = 1 << 10, 1 << 20
DEFAULT_GRID: dict[str, tuple[int, ...]] = {
    "block_size": (256 * KIB, MIB, 4 * MIB),
    "queue_depth": (4, 16),
    "thread_count": (1, 4),
}
_AIO_FIELD = {"block_size": "block_size_bytes", "queue_depth": "queue_depth", "thread_count": "thread_count"}


def nvme_tiers(cfg: TieredConfig) -> list[str]:
    return [n for n, t in cfg.tiered.tiers.items() if t.backend.get("type") == "nvme"]


def with_setting(cfg: TieredConfig, setting: dict[str, int]) -> TieredConfig:
    """`cfg` with `setting` in its aio section and in every nvme tier's backend spec."""
    tiers = {
        n: dataclasses.replace(t, backend={**t.backend, **setting}) if t.backend.get("type") == "nvme" else t
        for n, t in cfg.tiered.tiers.items()
    }
    aio = dataclasses.replace(
        cfg.aio,
        block_size_bytes=setting.get("block_size", cfg.aio.block_size_bytes),
        queue_depth=setting.get("queue_depth", cfg.aio.queue_depth),
        thread_count=setting.get("thread_count", cfg.aio.thread_count),
    )
    return dataclasses.replace(cfg, aio=aio, tiered=dataclasses.replace(cfg.tiered, tiers=tiers))


@dataclass(frozen=True)
class SettingResult:
    setting: dict[str, int]
    io_s: tuple[float, ...]
    """Per round: I/O seconds of the measured step, summed over the storage links."""
    last: TrainingBenchResult

    @property
    def median_io_s(self) -> float:
        return statistics.median(self.io_s)


@dataclass(frozen=True)
class TuneResult:
    results: tuple[SettingResult, ...]
    tiers: tuple[str, ...]
    best_config: TieredConfig

    @property
    def best(self) -> SettingResult:
        return min(self.results, key=lambda r: r.median_io_s)

    def fragment(self) -> dict[str, Any]:
        s = self.best.setting
        return {
            "aio": dict(s),
            "tiered": {"tiers": {t: {"backend": {"type": "nvme", **s}} for t in self.tiers}},
        }

    def write_fragment(self, path: Path) -> None:
        path.write_text(json.dumps(self.fragment(), indent=2) + "\n")

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": [
                {
                    **r.setting,
                    "io_s_per_step": list(r.io_s),
                    "median_io_s_per_step": r.median_io_s,
                    "links": {f.link: f.gbps for f in r.last.links},
                }
                for r in self.results
            ],
            "best": self.best.setting,
            "fragment": self.fragment(),
        }

    def to_markdown(self) -> str:
        links = sorted({f.link for r in self.results for f in r.last.links})
        head = (
            "| block | queue depth | threads | I/O s/step (median) | "
            + " | ".join(f"{k} GB/s" for k in links)
            + " |"
        )
        lines = ["tune: the training pattern per setting, round-robin, median", "", head]
        lines.append("|" + "---|" * (4 + len(links)))
        best = self.best
        for r in sorted(self.results, key=lambda r: r.median_io_s):
            g = {f.link: f.gbps for f in r.last.links}
            cells = " | ".join("-" if g.get(k) is None else f"{g[k]:.2f}" for k in links)
            mark = " (best)" if r is best else ""
            lines.append(
                f"| {format_bytes(r.setting['block_size'], binary=True)} | {r.setting['queue_depth']} | "
                f"{r.setting['thread_count']} | {r.median_io_s:.3f}{mark} | {cells} |"
            )
        return "\n".join(lines) + "\n"


def tune_training(
    model: nn.Module,
    cfg: TieredConfig,
    *,
    steps: int = 3,
    warmup: int = 1,
    grid: dict[str, Sequence[int]] | None = None,
    compute_s: float = 0.0,
    progress: Callable[[str], None] | None = None,
) -> TuneResult:
    """Sweep `grid` (default DEFAULT_GRID) for `steps` round-robin rounds; see the module doc."""
    tiers = nvme_tiers(cfg)
    if not tiers:
        raise ConfigError(
            "--tune sweeps the nvme backend's knobs, but this config puts nothing on an nvme tier "
            "(set zero_optimization.offload_optimizer.device or offload_param.device to nvme)"
        )
    grid = dict(grid or DEFAULT_GRID)
    keys = list(_AIO_FIELD)
    settings = [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*(grid[k] for k in keys))]
    say = progress or (lambda _m: None)
    io: list[list[float]] = [[] for _ in settings]
    last: list[TrainingBenchResult | None] = [None] * len(settings)
    add_total(progress, len(settings) * max(1, steps))
    for r in range(max(1, steps)):
        order = list(range(len(settings)))
        k = r % len(order)
        for i in order[k:] + order[:k]:
            res = bench_training(
                model, with_setting(cfg, settings[i]), steps=1, warmup=max(1, warmup), compute_s=compute_s
            )
            if not any(f.link for f in res.links):
                raise ConfigError(
                    "--tune: this model + config moves no bytes to its nvme tier; nothing to tune"
                )
            io[i].append(sum(f.seconds_per_step for f in res.links))
            last[i] = res
            say(f"tune round {r + 1}/{max(1, steps)} {settings[i]}: {io[i][-1]:.3f} s of I/O per step")
    results = tuple(
        SettingResult(s, tuple(t), lr) for s, t, lr in zip(settings, io, last, strict=True) if lr is not None
    )
    best = min(results, key=lambda x: x.median_io_s)
    return TuneResult(results, tuple(tiers), with_setting(cfg, best.setting))
