"""`tiered bench --training`: replay one model + config's storage I/O per step and report the
GB/s and seconds of I/O per link that training will see.

The pattern is `tiered.bench.pattern.derive_pattern` ([Note: training I/O pattern]); the moves go
through a TierManager that the engine's own `build_tier_manager` opens from the same config, so
the backend spec (swap files: in place, no fsync), the checksums and the link accounting are
training's. Each step's figure is the difference of `TierManager.stats()` around it, the same
counters `engine.stats()` reports; the result is the mean over the measured steps.

[Note: compute between the moves]
A drive (and the VM in front of it) delivers more while it gets rests: on the 2-core VM of
benchmarks/RESULTS.md the same replay ran 1.24-1.4x faster with 3 s of idle time per step than
back to back. Training's storage links rest while forward and backward compute (the whole pass
when the parameters stay in memory), so the replay takes that compute time, `compute_s`, split
between the two passes, each gathered group computing its share by size, as host matrix products
where the "gpu" tier is host memory (there the compute takes the cores the I/O's copies and
checksums need, as training's does) and as a sleep where a GPU computes. 0 (the default)
replays the moves back to back, the busiest case; `--compute-s` gives it, and `--check` measures
it from the real run (forward + backward minus the training thread's tier stalls) and replays
with that.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tiered.bench.pattern import PartitionIO, TrainingPattern, derive_pattern
from tiered.bench.progress import add_total, note
from tiered.errors import ConfigError
from tiered.units import format_bytes

if TYPE_CHECKING:
    from torch import nn

    from tiered.config.schema import TieredConfig
    from tiered.tiers import Partition, TierManager

log = logging.getLogger(__name__)

FORWARD_WINDOW = 2
"""Parameter groups in flight in a pass: the one computing and the one prefetched next."""


@dataclass(frozen=True)
class LinkFigure:
    link: str
    bytes_per_step: float
    seconds_per_step: float
    """Busy seconds per step (the union of the moves' intervals, [Note: link busy time])."""
    ops_per_step: float
    max_inflight: int

    @property
    def gbps(self) -> float | None:
        return self.bytes_per_step / self.seconds_per_step / 1e9 if self.seconds_per_step > 0 else None


@dataclass(frozen=True)
class TrainingBenchResult:
    pattern: TrainingPattern
    steps: int
    warmup: int
    directory: str
    filesystem: str
    date: str
    machine: dict[str, Any]
    links: tuple[LinkFigure, ...]
    compute_s: float = 0.0

    def link(self, name: str) -> LinkFigure | None:
        return next((f for f in self.links if f.link == name), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "pattern": self.pattern.to_json(),
            "steps": self.steps,
            "warmup": self.warmup,
            "directory": self.directory,
            "filesystem": self.filesystem,
            "date": self.date,
            "machine": self.machine,
            "compute_s": self.compute_s,
            "links": {f.link: {**dataclasses.asdict(f), "gbps": f.gbps} for f in self.links},
        }

    def to_markdown(self) -> str:
        lines = [
            f"training pattern: {self.pattern.describe()}",
            *(f"  note: {n}" for n in self.pattern.notes),
            f"replayed {self.steps} steps after {self.warmup} warm-up in {self.directory} ({self.filesystem}); "
            "swap mode (in place, no fsync) through the engine's tier manager; "
            + (
                f"{self.compute_s:.3f} s of forward + backward compute per step between the moves; "
                if self.compute_s
                else "moves back to back (no compute time given: the busiest case); "
            )
            + "mean per step",
            "",
            "| link | bytes/step | moves/step | max in flight | predicted GB/s | I/O s/step |",
            "|---|---|---|---|---|---|",
        ]
        for f in self.links:
            g = "-" if f.gbps is None else f"{f.gbps:.2f}"
            lines.append(
                f"| {f.link} | {format_bytes(int(f.bytes_per_step))} | {f.ops_per_step:.0f} | "
                f"{f.max_inflight} | {g} | {f.seconds_per_step:.3f} |"
            )
        if not self.links:
            lines.append("| (none) | this model + config moves no bytes to a storage tier | | | | |")
        return "\n".join(lines) + "\n"


def with_directory(cfg: TieredConfig, directory: Path | None) -> TieredConfig:
    """`cfg` with every storage tier's "path" moved to `directory` (``--dir``): the drive to
    measure; None keeps the config's own paths (the drive training will use). A swap tier (the
    offload tiers) writes into `directory` itself, as into an nvme_path: its backend makes a
    private folder there that closing removes. Any other tier gets ``directory/<tier>``, made
    owner-only where missing, so two tiers' keys cannot meet."""
    if directory is None:
        return cfg
    tiers = {}
    for name, spec in cfg.tiered.tiers.items():
        if isinstance(spec.backend.get("path"), str):
            path = directory
            if not spec.backend.get("swap"):
                path = directory / name
                path.mkdir(mode=0o700, exist_ok=True)
            spec = dataclasses.replace(spec, backend={**spec.backend, "path": str(path)})
        tiers[name] = spec
    return dataclasses.replace(cfg, tiered=dataclasses.replace(cfg.tiered, tiers=tiers))


def storage_directories(cfg: TieredConfig, storage_tiers: tuple[str, ...]) -> list[Path]:
    out = []
    for t in storage_tiers:
        path = cfg.tiered.tiers[t].backend.get("path") if t in cfg.tiered.tiers else None
        if isinstance(path, str):
            out.append(Path(path))
    return out


class TrainingReplay:
    """An open replay: the space checked, the tier manager built from the config, the
    partitions created; `step()` moves one step's bytes and returns the per-link deltas."""

    def __init__(self, model: nn.Module, cfg: TieredConfig, compute_s: float = 0.0) -> None:
        from tiered.bench.preflight import check_free_space
        from tiered.engine.build import build_tier_manager
        from tiered.engine.residency import tier_rooms
        from tiered.optim.placement import tier_is_host

        if compute_s < 0:
            raise ConfigError(f"--compute-s must be >= 0 seconds, got {compute_s}")
        # the space check comes before anything is opened or written: the bytes stored do not
        # depend on the gpu budget (it only caps how parameters are grouped), so plan without it
        first = derive_pattern(model, cfg, gpu_budget_bytes=None, gpu_is_host=True)
        self.dirs = storage_directories(cfg, first.storage_tiers)
        need = sum({p.name: p.nbytes for p in first.partitions}.values())
        for d in self.dirs[:1]:
            check_free_space(d, need, "the training pattern's partitions, each stored once")
        self.tm = build_tier_manager(cfg)
        try:
            self.pattern = derive_pattern(
                model,
                cfg,
                gpu_budget_bytes=self.tm.budget_bytes("gpu"),
                gpu_is_host=tier_is_host(self.tm, "gpu"),
                rooms=tier_rooms(self.tm, cfg, world_size=1),  # what training's manager would keep
            )
            self._replay = _Replay(
                self.tm, self.pattern, compute_s, compute_on_host=tier_is_host(self.tm, "gpu")
            )
        except BaseException:
            self.tm.close()
            raise

    @property
    def compute_s(self) -> float:
        return self._replay.compute_s

    @compute_s.setter
    def compute_s(self, seconds: float) -> None:
        self._replay.compute_s = max(0.0, float(seconds))

    def step(self) -> dict[str, dict[str, float]]:
        before = self.tm.stats()["links"]
        self._replay.step()
        return _delta(before, self.tm.stats()["links"])

    def max_inflight(self) -> dict[str, int]:
        return {k: int(v.get("max_inflight", 0)) for k, v in self.tm.stats()["links"].items()}

    def result(self, samples: list[dict[str, dict[str, float]]], warmup: int) -> TrainingBenchResult:
        from tiered.bench.runner import _filesystem, machine_info

        return TrainingBenchResult(
            pattern=self.pattern,
            steps=len(samples),
            warmup=warmup,
            directory=", ".join(str(d) for d in self.dirs) or "-",
            filesystem=_filesystem(self.dirs[0]) if self.dirs else "-",
            date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            machine=machine_info(),
            links=link_figures(samples, self.max_inflight(), self.pattern.storage_tiers),
            compute_s=self.compute_s,
        )

    def close(self) -> None:
        self.tm.close()


def describe_step(delta: dict[str, dict[str, float]]) -> str:
    return ", ".join(
        f"{k} {v['bytes'] / v['seconds'] / 1e9:.2f} GB/s"
        for k, v in sorted(delta.items())
        if v["seconds"] > 0
    )


def bench_training(
    model: nn.Module,
    cfg: TieredConfig,
    *,
    steps: int = 3,
    warmup: int = 1,
    compute_s: float = 0.0,
    progress: Callable[[str], None] | None = None,
) -> TrainingBenchResult:
    """Derive the pattern of `model` + `cfg` and replay it `warmup` + `steps` times, with
    `compute_s` seconds of forward + backward compute per step between the moves
    ([Note: compute between the moves])."""
    if steps < 1 or warmup < 0:
        raise ConfigError(f"--steps must be >= 1 (got {steps}) and --warmup >= 0 (got {warmup})")
    say = progress or (lambda _m: None)
    replay = TrainingReplay(model, cfg, compute_s)
    try:
        note(progress, replay.pattern.describe())
        add_total(progress, warmup + steps)
        samples: list[dict[str, dict[str, float]]] = []
        for s in range(warmup + steps):
            delta = replay.step()
            if s >= warmup:
                samples.append(delta)
            say(f"step {s + 1}/{warmup + steps}{' (warm-up)' if s < warmup else ''}: {describe_step(delta)}")
        return replay.result(samples, warmup)
    finally:
        replay.close()


def _delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, dict[str, float]]:
    out = {}
    for k, v in b.items():
        u = a.get(k, {})
        nbytes = v["bytes"] - u.get("bytes", 0)
        if nbytes:
            out[k] = {
                "bytes": nbytes,
                "seconds": v["seconds"] - u.get("seconds", 0.0),
                "ops": v["ops"] - u.get("ops", 0),
            }
    return out


def link_touches(link: str, tiers: tuple[str, ...]) -> bool:
    src, _, dst = link.partition("->")
    return src in tiers or dst in tiers


def link_figures(
    samples: list[dict[str, dict[str, float]]], max_inflight: dict[str, int], storage: tuple[str, ...]
) -> tuple[LinkFigure, ...]:
    """Per storage link, the mean per step over `samples` (per-step deltas of the link counters).
    Means, not medians: a step's last write-backs finish inside the next step's window
    ([Note: write-back after the step]), so single steps split them unevenly, their sum does not."""
    names = sorted({k for s in samples for k in s if link_touches(k, storage)})
    n = max(1, len(samples))
    out = []
    for k in names:
        vals = [s.get(k, {"bytes": 0, "seconds": 0.0, "ops": 0}) for s in samples]
        out.append(
            LinkFigure(
                k,
                sum(v["bytes"] for v in vals) / n,
                sum(v["seconds"] for v in vals) / n,
                sum(v["ops"] for v in vals) / n,
                max_inflight.get(k, 0),
            )
        )
    return tuple(out)


def _pipeline_units(moves: list[PartitionIO]) -> list[list[PartitionIO]]:
    """The step's moves in the units its pipeline takes them: one tile of a group's state
    (``g0003.exp_avg.t0001`` with ``g0003.exp_avg_sq.t0001``, ...), the group's gradient and
    parameter as one more ([Note: sub-group pipeline]); in order of first appearance."""
    units: dict[str, list[PartitionIO]] = {}
    for p in moves:
        parts = p.name.split(".")
        key = parts[0] + ("." + parts[2] if len(parts) > 2 else "")
        units.setdefault(key, []).append(p)
    return list(units.values())


class _Replay:
    """The partitions of a pattern in a TierManager, moved as one training step moves them."""

    def __init__(
        self, tm: TierManager, pattern: TrainingPattern, compute_s: float = 0.0, *, compute_on_host: bool
    ) -> None:
        self.tm, self.pattern = tm, pattern
        self.compute_s = max(0.0, float(compute_s))
        self.compute_on_host = compute_on_host
        self._a = torch.randn(256, 256) if compute_on_host else None
        self.parts: dict[str, Partition] = {}
        for p in pattern.partitions:
            if p.name not in self.parts:
                self.parts[p.name] = tm.create(p.name, p.numel, p.dtype, p.home)

    def compute(self, seconds: float) -> None:
        """Stand in for `seconds` of model compute: host matrix products on torch's threads where
        the "gpu" tier is host memory (the compute then competes with the I/O for the cores, as
        training's does), a sleep where a real GPU computes."""
        if seconds <= 0:
            return
        if self._a is None:
            time.sleep(seconds)
            return
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            torch.mm(self._a, self._a)

    def _phase(self, phase: str) -> list[PartitionIO]:
        return [p for p in self.pattern.partitions if p.phase == phase]

    def step(self) -> None:
        micro = self.pattern.micro_batches
        # forward ~ 1/3, backward ~ 2/3 of the FLOPs; the split hardly matters
        half = self.compute_s / 2 / micro
        backward = self._phase("backward")
        for m in range(micro):
            self._pass(self._phase("forward"), half)
            if m == micro - 1:
                self._prefetch_states()  # as the engine does when the step's backward begins
            self._pass([p for p in reversed(backward) if p.stage == "gpu"], half)
            for p in reversed(backward):  # staged gradients: one group at a time, written back
                if p.stage != "gpu":
                    part = self.parts[p.name]
                    # the first flush after zeroing overwrites all of it: allocated, not read
                    # ([Note: gradients on nvme]); each later micro-batch's adds to it: read first
                    (self.tm.fetch(part, p.stage) if m else self.tm.allocate(part, p.stage)).result()
                    self.tm.mark_dirty(part, p.stage)
                    self.tm.release(part, p.stage)
                    self.tm.evict(part, p.stage).result()
        self._optimizer(self._phase("step"))
        self._prefetch_next_forward()

    def _prefetch_next_forward(self) -> None:
        """The next forward's first parameter groups, read now, as the engine's step issues
        them (`ZeroParameters.params_updated`); waited for, as `--check` waits for the real
        step's, so their bytes land in this step."""
        futs = [
            self.tm.prefetch(self.parts[p.name], p.stage)
            for p in self._phase("forward")
            if p.name in self.pattern.after_step_prefetch
        ]
        for f in futs:
            f.result()

    def _step_groups(self) -> list[list[PartitionIO]]:
        return _pipeline_units(self._phase("step"))

    def _prefetch_states(self) -> None:
        """The first groups' optimizer-state reads start with backward (unpinned), as
        `OffloadedAdam.prefetch_states` starts them; the step's fetches then find them."""
        for group in self._step_groups()[: self.pattern.prefetch_groups]:
            for p in group:
                if p.reads and not p.name.endswith(".grad"):
                    self.tm.prefetch(self.parts[p.name], p.stage)

    def _pass(self, moves: list[PartitionIO], compute_s: float) -> None:
        """Parameter reads of one pass, FORWARD_WINDOW in flight; each group computes its share
        of `compute_s` (by size) once gathered, then is freed."""
        tm, inflight = self.tm, deque[tuple[PartitionIO, Any]]()
        if not moves:
            self.compute(compute_s)  # the links rest while the pass computes
            return
        total = sum(p.numel for p in moves)

        def finish() -> None:
            p, fut = inflight.popleft()
            fut.result()
            self.compute(compute_s * p.numel / total)
            tm.release(self.parts[p.name], p.stage)
            if not (p.phase == "forward" and p.name in self.pattern.live_into_step):
                tm.evict(self.parts[p.name], p.stage).result()  # clean: frees it

        for p in moves:
            inflight.append((p, tm.fetch(self.parts[p.name], p.stage)))
            if len(inflight) >= FORWARD_WINDOW:
                finish()
        while inflight:
            finish()

    def _optimizer(self, moves: list[PartitionIO]) -> None:
        """The sub-group pipeline: buffer_count groups read ahead, then each group's write-backs;
        the window counts the write-backs in flight too ([Note: sub-group pipeline])."""
        tm = self.tm
        groups = _pipeline_units(moves)
        reads: dict[int, list[Any]] = {}
        pending: deque[list[Any]] = deque()
        window = self.pattern.buffer_count

        def issue(k: int) -> None:
            reads[k] = [
                tm.fetch(self.parts[p.name], p.stage) if p.reads else tm.allocate(self.parts[p.name], p.stage)
                for p in groups[k]
            ]

        def retire() -> None:
            for f in pending.popleft():
                f.result()

        nxt = 0
        for k, group in enumerate(groups):
            if nxt == k:
                while pending and len(pending) + 1 > window:
                    retire()
                issue(k)
                nxt += 1
            while nxt < len(groups) and (nxt - k) + len(pending) < window:
                issue(nxt)
                nxt += 1
            for f in reads.pop(k):
                f.result()
            futs = []
            for p in group:
                part = self.parts[p.name]
                if p.writes and p.reads:
                    tm.mark_dirty(part, p.stage)
                tm.release(part, p.stage)
                futs.append(tm.evict(part, p.stage))
            pending.append(futs)
        while pending:
            retire()
