"""The fine-tuning loop through the engine and the plain-PyTorch reference.

[Note: what a step is]
`steps` counts optimizer steps. With gradient_accumulation_steps = G one step is G micro-batches,
each fed as engine(**batch); engine.backward(loss); engine.step() (the engine only steps at the
boundary). The loss logged for a step is the mean of its G micro-batch losses; tokens counted are
G * batch_size * seq_len per step. The reference (`reference_train`) runs the same micro-batches
through torch.optim.AdamW (Adam with L2 when the config says adam_w_mode false), with the same
clipping and lr schedule: on fp32 the two must agree to rounding.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tiered.config.schema import TieredConfig
from tiered.errors import ConfigError

log = logging.getLogger(__name__)

Batch = dict[str, Any]


@dataclass(frozen=True)
class StepLog:
    step: int
    loss: float
    lr: float
    tokens_per_s: float
    elapsed_s: float
    link_gbps: dict[str, float] = field(default_factory=dict)
    """Per link (source->destination), GB/s since the previous log; only with `link_rates`."""


@dataclass(frozen=True)
class TrainOptions:
    """How long, what to report and keep, and what to resume from: everything `train` is told
    besides the model, the config and the data ([Note: what a step is]). One value rather than a
    dozen keywords, so a caller states a run in one place and the loop reads one object."""

    steps: int
    log_every: int = 1
    on_log: Callable[[StepLog], None] | None = field(default=None, compare=False)
    """Called every `log_every` steps and after the last."""
    keep_state: bool = False
    """Gather the consolidated fp32 parameters into `TrainResult.state`."""
    eval_data: Callable[[], Iterable[Batch]] | None = field(default=None, compare=False)
    """A fresh iterable of eval batches per call: the eval loss is taken every `eval_every`
    steps and after the last step (`eval_loss`)."""
    eval_every: int = 0
    on_eval: Callable[[int, float], None] | None = field(default=None, compare=False)
    """Called with (step, eval loss) after each evaluation."""
    link_rates: bool = False
    """Fill StepLog.link_gbps (it reads engine.stats() at every log, so it is off unless a
    progress bar shows it)."""
    trace_compute: bool = False
    """Add module compute and step spans to the engine's trace when the config records one
    (tiered.trace_path; [Note: compute spans])."""
    weights: str | os.PathLike[str] | None = None
    """Stream the weights from this folder at initialize ([Note: streaming load])."""
    checkpoints: Any = field(default=None, compare=False)
    """A tiered.finetune.checkpointing.CheckpointPolicy: resumes, saves and exports
    ([Note: run directory]); a stop it asks for ends the loop as an interrupt does."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.log_every < 1:
            raise ConfigError(f"--log-every must be >= 1, got {self.log_every}")
        if self.eval_data is not None and self.eval_every < 1:
            raise ConfigError(f"--eval-every must be >= 1, got {self.eval_every}")


@dataclass(frozen=True)
class TrainResult:
    losses: tuple[float, ...]
    steps_done: int
    tokens: int
    init_s: float
    train_s: float
    interrupted: bool
    stats: dict[str, Any]
    state: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    eval_losses: tuple[tuple[int, float], ...] = ()
    """(step, eval loss) every --eval-every steps; see `eval_loss`."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_s if self.train_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "steps_done": self.steps_done,
            "losses": list(self.losses),
            "final_loss": self.losses[-1] if self.losses else None,
            "tokens": self.tokens,
            "init_s": self.init_s,
            "train_s": self.train_s,
            "tokens_per_s": self.tokens_per_s,
            "interrupted": self.interrupted,
            "eval_losses": [{"step": st, "loss": v} for st, v in self.eval_losses],
            "engine": self.stats,
        }


def micro_batch_size(cfg: TieredConfig, override: int | None) -> int:
    if override is not None:
        return override
    return cfg.train_micro_batch_size_per_gpu or 1


def eval_loss(model: torch.nn.Module, forward: Callable[..., Any], batches: Iterable[Batch]) -> float:
    """The mean loss per trained token over `batches`, without gradients and with the model in
    eval mode (no dropout): each batch's mean loss weighted by its trained (label != -100, after
    the causal shift) tokens, so it does not depend on how the rows are batched."""
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for b in batches:
                n = int((b["labels"][:, 1:] != -100).sum())
                if n:
                    total += float(forward(**b).loss.float()) * n
                    count += n
    finally:
        model.train(was_training)
    return total / count if count else float("nan")


def train(
    model: torch.nn.Module,
    config: TieredConfig | dict[str, Any],
    stream: Iterator[Batch],
    opts: TrainOptions,
    **options: Any,
) -> TrainResult:
    """Fine-tune `model` for opts.steps optimizer steps through tiered's engine, as `opts` says.

    A KeyboardInterrupt (Ctrl-C) between or inside steps ends the loop cleanly: the engine is
    closed (its writes finished, its loop thread stopped) and the result says `interrupted`,
    with the steps done so far. Under torch.distributed the logged loss is the mean over ranks
    and tokens count the global batch ([Note: ranks in finetune]). `options`: fields of
    `TrainOptions` given as keywords (``keep_state=True``), over those of `opts`, as callers
    wrote them before the options were one value."""
    if options:
        opts = dataclasses.replace(opts, **options)
    on_log, eval_data, on_eval, checkpoints = opts.on_log, opts.eval_data, opts.on_eval, opts.checkpoints
    import tiered

    t0 = time.perf_counter()
    engine = tiered.initialize(model, config, weights=opts.weights)  # weights: [Note: streaming load]
    init_s = time.perf_counter() - t0
    gas = engine.gas
    world = int(engine.world_size)
    tracer = None
    if opts.trace_compute and engine.tm.tracing:
        from tiered.finetune.trace import ComputeTracer

        tracer = ComputeTracer(model, engine.tm)
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    tokens = 0
    interrupted = False
    state = None
    t_start = time.perf_counter()
    train_s = 0.0
    last_links: dict[str, int] = {}
    last_t = t_start

    def rates() -> dict[str, float]:
        nonlocal last_links, last_t
        now = time.perf_counter()
        links = {
            k: int(v.get("bytes", 0)) for k, v in engine.stats().get("tiers", {}).get("links", {}).items()
        }
        dt = now - last_t
        got = {k: (b - last_links.get(k, 0)) / dt / 1e9 for k, b in links.items()} if dt > 0 else {}
        last_links, last_t = links, now
        return got

    with engine:
        try:
            first = 1 + (checkpoints.start(engine, stream) if checkpoints is not None else 0)
            for step in range(first, opts.steps + 1):
                t_step = time.perf_counter()
                lr = engine.get_lr()[0]
                micro: list[float] = []
                for _ in range(gas):
                    batch = next(stream)
                    out = engine(**batch)
                    engine.backward(out.loss)
                    engine.step()
                    micro.append(float(out.loss.detach().float()))
                    tokens += int(batch["input_ids"].numel()) * world
                loss = sum(micro) / len(micro)
                if world > 1:
                    loss = _mean_over_ranks(loss)
                engine.tm.record_span(f"step {step}", "step", t_step, time.perf_counter(), loss=loss)
                if not math.isfinite(loss):
                    log.warning("step %d: loss is %s", step, loss)
                losses.append(loss)
                train_s = time.perf_counter() - t_start
                if on_log is not None and (step % opts.log_every == 0 or step == opts.steps):
                    on_log(
                        StepLog(
                            step,
                            loss,
                            lr,
                            tokens / train_s if train_s > 0 else 0.0,
                            train_s,
                            rates() if opts.link_rates else {},
                        )
                    )
                if eval_data is not None and (step % opts.eval_every == 0 or step == opts.steps):
                    evals.append((step, eval_loss(model, engine, eval_data())))
                    if on_eval is not None:
                        on_eval(*evals[-1])
                if checkpoints is not None and checkpoints.after_step(
                    engine, stream, step, step == opts.steps
                ):
                    interrupted = True
                    break
        except KeyboardInterrupt:
            interrupted = True
            log.warning("interrupted after %d steps; closing the engine", len(losses))
        train_s = time.perf_counter() - t_start
        if tracer is not None:
            tracer.remove()
        stats = engine.stats()
        if opts.keep_state and not interrupted:
            state = {k: v.detach().float().clone() for k, v in engine.state_dict_fp32().items()}
        if checkpoints is not None and not interrupted:
            checkpoints.export(engine, model)
    return TrainResult(
        tuple(losses), len(losses), tokens, init_s, train_s, interrupted, stats, state, tuple(evals)
    )


def _mean_over_ranks(x: float) -> float:
    """The mean of `x` over the default process group (every rank's loss of the step)."""
    import torch.distributed as dist

    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor([x], dtype=torch.float64, device=on)  # NCCL reduces device tensors only
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def reference_train(
    model: torch.nn.Module,
    cfg: TieredConfig,
    stream: Iterator[Batch],
    steps: int,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same run in plain PyTorch ([Note: what a step is]); fp32 configs only."""
    from tiered.optim.schedulers import build_scheduler

    if cfg.precision.dtype != torch.float32:
        raise ConfigError(
            "the plain-PyTorch comparison runs fp32 only; drop bf16/fp16 from the config to compare"
        )
    o = cfg.optimizer
    # frozen parameters (LoRA's base) are not stepped, as by the engine: a zero gradient would
    # still move them through weight decay
    params = [p for p in model.parameters() if p.requires_grad]
    opt_cls = torch.optim.AdamW if o.adamw_mode else torch.optim.Adam
    opt = opt_cls(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    schedule = build_scheduler(cfg.scheduler, base_lr=o.lr) if cfg.scheduler is not None else None
    gas = int(cfg.gradient_accumulation_steps)
    model.train()
    losses: list[float] = []
    for step in range(steps):
        micro = []
        for _ in range(gas):
            out = model(**next(stream))
            micro.append(float(out.loss.detach()))
            (out.loss / gas).backward()
        for p in params:
            if p.grad is None:  # as the engine: a parameter without a gradient steps with zero
                p.grad = torch.zeros_like(p)
        if cfg.gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.gradient_clipping)
        if schedule is not None:
            for grp in opt.param_groups:
                grp["lr"] = schedule.lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(sum(micro) / gas)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def max_rel_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The worst ||a - b|| / ||b|| over parameters (norm-relative: see the equivalence tests'
    [Note: equivalence metric]) and its parameter name."""
    worst, name = 0.0, ""
    for n, b in want.items():
        if n not in got:
            raise KeyError(f"parameter {n} is missing from the engine's consolidated state")
        a = got[n].detach().double().reshape(-1)
        bb = b.detach().double().reshape(-1)
        d = float((a - bb).norm()) / (float(bb.norm()) or 1.0)
        if d > worst:
            worst, name = d, n
    return worst, name
