"""`tiered bench --training --check`: real training steps of the same model + config on the
same drive, interleaved round-robin with the replay's steps, their `engine.stats()` link
figures next to the prediction.

Each round runs one real step (the model built with real, seeded weights, on random tokens) and
one replayed step, the order rotated ([Note: round-robin measurement]): the drive's drift
reaches both alike. Round 0 (real first) warms both up; the replay's compute time between its
moves is the median of the real steps' forward + backward compute so far ([Note: compute
between the moves]). Each step's link figures are the difference of the link counters around it,
the mean over the measured steps; the ratio measured / predicted is reported per link, the
target within 20% (0.8 .. 1.2).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiered.bench.progress import add_total, note
from tiered.bench.training import LinkFigure, TrainingBenchResult, _delta, link_figures
from tiered.units import format_bytes

if TYPE_CHECKING:
    from torch import nn

    from tiered.config.schema import TieredConfig

TOLERANCE = 0.20


@dataclass(frozen=True)
class CheckRow:
    link: str
    predicted: LinkFigure | None
    measured: LinkFigure | None

    @property
    def gbps_ratio(self) -> float | None:
        p = self.predicted.gbps if self.predicted else None
        m = self.measured.gbps if self.measured else None
        return m / p if p and m else None

    @property
    def bytes_ratio(self) -> float | None:
        p = self.predicted.bytes_per_step if self.predicted else 0
        m = self.measured.bytes_per_step if self.measured else 0
        return m / p if p else None

    @property
    def within(self) -> bool:
        r, b = self.gbps_ratio, self.bytes_ratio
        return r is not None and b is not None and abs(r - 1) <= TOLERANCE and abs(b - 1) <= TOLERANCE


@dataclass(frozen=True)
class TrainingCheck:
    prediction: TrainingBenchResult
    steps: int
    step_s: float
    rows: tuple[CheckRow, ...]
    compute_s: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.within for r in self.rows)

    def to_json(self) -> dict[str, Any]:
        def fig(f: LinkFigure | None) -> dict[str, Any] | None:
            return (
                None
                if f is None
                else {
                    "bytes_per_step": f.bytes_per_step,
                    "seconds_per_step": f.seconds_per_step,
                    "gbps": f.gbps,
                }
            )

        return {
            "steps": self.steps,
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "tolerance": TOLERANCE,
            "within_tolerance": self.ok,
            "links": {
                r.link: {
                    "predicted": fig(r.predicted),
                    "measured": fig(r.measured),
                    "gbps_ratio": r.gbps_ratio,
                    "bytes_ratio": r.bytes_ratio,
                }
                for r in self.rows
            },
        }

    def to_markdown(self) -> str:
        def g(f: LinkFigure | None) -> str:
            return "-" if f is None or f.gbps is None else f"{f.gbps:.2f}"

        def b(f: LinkFigure | None) -> str:
            return "-" if f is None else format_bytes(int(f.bytes_per_step))

        def s(f: LinkFigure | None) -> str:
            return "-" if f is None else f"{f.seconds_per_step:.3f}"

        def x(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        lines = [
            f"check: {self.steps} real training steps of the same model + config on the same drive, "
            "round-robin with the replayed steps "
            f"(median step {self.step_s:.3f} s, of which {self.compute_s:.3f} s forward + backward compute, "
            "given to the replay), engine.stats() per step vs the replay",
            "",
            "| link | predicted bytes/step | measured bytes/step | predicted GB/s | measured GB/s | "
            "measured / predicted GB/s | predicted I/O s/step | measured I/O s/step | within 20% |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            lines.append(
                f"| {r.link} | {b(r.predicted)} | {b(r.measured)} | {g(r.predicted)} | {g(r.measured)} | "
                f"{x(r.gbps_ratio)} | {s(r.predicted)} | {s(r.measured)} | {'yes' if r.within else 'no'} |"
            )
        return "\n".join(lines) + "\n"


def random_batch(model: nn.Module, cfg: TieredConfig, seq_len: int, seed: int) -> dict[str, Any]:
    """Random tokens for a causal LM: micro-batch size from the config, labels = inputs."""
    import torch

    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    if vocab < 2:
        raise ValueError("--check trains a causal LM: the model needs config.vocab_size")
    micro = int(cfg.train_micro_batch_size_per_gpu or 1)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (micro, seq_len), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


@dataclass(frozen=True)
class RealRun:
    links: tuple[LinkFigure, ...]
    step_s: float
    """Median wall time of a step."""
    compute_s: float
    """Median forward + backward time minus the training thread's tier stalls in them: the
    compute the replay puts between its moves ([Note: compute between the moves])."""


@dataclass(frozen=True)
class _StepSample:
    """One measured real step: its link-counter deltas, wall time and compute time."""

    delta: dict[str, dict[str, float]]
    step_s: float
    compute_s: float


def _real_step(engine: Any, model: nn.Module, cfg: TieredConfig, seq_len: int, seed: int) -> _StepSample:
    """One real training step of `engine` on random tokens (seeded by `seed`), measured; the
    compute time is forward + backward minus the training thread's tier stalls in them ([Note:
    compute between the moves])."""
    import time

    micro = max(1, int(cfg.gradient_accumulation_steps))
    before = engine.stats()["tiers"]
    t0 = time.perf_counter()
    compute_s = 0.0
    for m in range(micro):  # one optimizer step: the engine steps at the last micro-batch
        batch = random_batch(model, cfg, seq_len, seed=seed * micro + m)
        stall0, c0 = engine.stats()["tiers"]["stall_s"], time.perf_counter()
        loss = engine(**batch).loss
        engine.backward(loss)
        compute_s += max(0.0, (time.perf_counter() - c0) - (engine.stats()["tiers"]["stall_s"] - stall0))
        if m < micro - 1:
            engine.step()
    engine.step()
    # the moves the step started land in this step's window, not in the next step's (or in the
    # replayed step that follows, where no real figure counts them and they compete with its
    # I/O): its last write-backs, and the next forward's first groups, which the step prefetches
    # (up to the whole model when the gpu budget allows; measured: 17-110 MB of a 110 MB model
    # landed after the step returned)
    getattr(engine.optimizer, "wait_writes", lambda: None)()
    engine.zero.wait_prefetches()
    dt = time.perf_counter() - t0
    delta = _delta(before["links"], engine.stats()["tiers"]["links"])
    return _StepSample(delta, dt, compute_s)


def _real_run(
    samples: list[dict[str, dict[str, float]]],
    links: dict[str, Any],
    storage: tuple[str, ...],
    times: list[float],
    computes: list[float],
) -> RealRun:
    """The measured steps' per-link figures (`links`: the engine's final link stats, for their
    high-water marks) and their median step and compute times."""
    max_inflight = {k: int(v.get("max_inflight", 0)) for k, v in links.items()}
    return RealRun(
        link_figures(samples, max_inflight, storage), statistics.median(times), statistics.median(computes)
    )


def measure_training(
    build: Callable[[], nn.Module],
    cfg: TieredConfig,
    *,
    steps: int,
    warmup: int,
    seq_len: int,
    progress: Callable[[str], None] | None = None,
) -> RealRun:
    """Per-link figures (mean per step), the median step and compute time of a real run."""
    import tiered

    say = progress or (lambda _m: None)
    model = build()
    add_total(progress, warmup + steps)
    samples, times, computes = [], [], []
    with tiered.initialize(model, cfg) as engine:
        for s in range(warmup + steps):
            step = _real_step(engine, model, cfg, seq_len, seed=s)
            if s >= warmup:
                samples.append(step.delta)
                times.append(step.step_s)
                computes.append(step.compute_s)
            say(
                f"training step {s + 1}/{warmup + steps}{' (warm-up)' if s < warmup else ''}: {step.step_s:.2f} s"
            )
        links = engine.stats()["tiers"]["links"]
    storage = tuple(sorted({t for k in samples for link in k for t in link.split("->")} - {"gpu", "cpu"}))
    return _real_run(samples, links, storage, times, computes)


def compare(prediction: TrainingBenchResult, real: RealRun, steps: int) -> TrainingCheck:
    """The replay's and the real run's figures side by side, per link."""
    names = sorted({f.link for f in prediction.links} | {f.link for f in real.links})
    by = {f.link: f for f in real.links}
    rows = tuple(CheckRow(k, prediction.link(k), by.get(k)) for k in names)
    return TrainingCheck(prediction, steps, real.step_s, rows, real.compute_s)


def check_round_robin(
    model: nn.Module,
    build: Callable[[], nn.Module],
    cfg: TieredConfig,
    *,
    steps: int,
    warmup: int,
    seq_len: int,
    compute_s: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> TrainingCheck:
    """The replay and the real run side by side, one step of each per round, the order rotated
    ([Note: round-robin measurement]): a drive that drifts drifts under both. The replay's compute
    time is the real steps' so far (median), unless `compute_s` gives it; round 0 runs the real
    step first and is a warm-up for both."""

    import tiered
    from tiered.bench.training import TrainingReplay, describe_step

    say = progress or (lambda _m: None)
    warmup = max(1, warmup)
    replay = TrainingReplay(model, cfg, compute_s or 0.0)
    try:
        note(progress, replay.pattern.describe())
        add_total(progress, 2 * (warmup + steps))
        real_model = build()
        real_samples: list[dict[str, dict[str, float]]] = []
        replay_samples: list[dict[str, dict[str, float]]] = []
        times: list[float] = []
        computes: list[float] = []
        with tiered.initialize(real_model, cfg) as engine:

            def real_step(s: int) -> None:
                step = _real_step(engine, real_model, cfg, seq_len, seed=s)
                computes.append(step.compute_s)
                if s >= warmup:
                    real_samples.append(step.delta)
                    times.append(step.step_s)
                say(
                    f"round {s + 1}/{warmup + steps} training step: {step.step_s:.2f} s, "
                    f"{describe_step(step.delta)}"
                )

            def replay_step(s: int) -> None:
                if compute_s is None:
                    replay.compute_s = statistics.median(computes)
                delta = replay.step()
                if s >= warmup:
                    replay_samples.append(delta)
                say(f"round {s + 1}/{warmup + steps} replayed step: {describe_step(delta)}")

            for s in range(warmup + steps):
                for run in (real_step, replay_step) if s % 2 == 0 else (replay_step, real_step):
                    run(s)
            links = engine.stats()["tiers"]["links"]
        prediction = replay.result(replay_samples, warmup)
    finally:
        replay.close()
    real = _real_run(
        real_samples, links, prediction.pattern.storage_tiers, times, computes[warmup:] or computes
    )
    return compare(prediction, real, steps)
