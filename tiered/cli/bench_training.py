"""`tiered bench --training` / `--check` / `--tune`: the options and the printout.

The measuring code is `tiered.bench.training` ([Note: training I/O pattern]), the real-run
check `tiered.bench.training_check`, the knob sweep `tiered.bench.tune`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from tiered.errors import ConfigError


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "training mode",
        "replay the storage I/O one training step of a model + config does (the engine's own grouping "
        "and placement; swap files, in place, no fsync) and predict each link's GB/s and I/O seconds per step",
    )
    g.add_argument(
        "--training", action="store_true", help="replay the training pattern of --model + --config"
    )
    g.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="local HF model folder or config.json (as tiered finetune)",
    )
    g.add_argument(
        "--config",
        metavar="JSON",
        default=None,
        help="DeepSpeed ds_config.json or tiered config (as tiered finetune)",
    )
    g.add_argument(
        "--steps", type=int, default=3, help="replayed (and --check: trained) steps after warm-up (default 3)"
    )
    g.add_argument(
        "--check",
        action="store_true",
        help="also train the model for --warmup + --steps real steps (random tokens) on the same drive and "
        "print engine.stats()'s link figures next to the prediction (exit 1 when a link is off by > 20%%)",
    )
    g.add_argument(
        "--compute-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="forward + backward compute per step, during which the storage links rest (default 0: the "
        "moves back to back, the busiest case; with --check: measured by the real run)",
    )
    g.add_argument("--seq-len", type=int, default=128, help="--check: tokens per sequence (default 128)")
    g.add_argument(
        "--tune",
        metavar="FRAGMENT.json",
        default=None,
        help="sweep block size, queue depth and threads on the training pattern and write the best aio "
        "block and tiered keys as a config fragment to this file",
    )


def wants_training(args: argparse.Namespace) -> bool:
    return bool(args.training or args.tune or args.check)


def load_model_and_config(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(meta model, resolved config, model source) from --model / --config; --dir moves the
    storage tiers' paths there."""
    from tiered.bench.training import with_directory
    from tiered.config import load_config
    from tiered.finetune.model import build_model, resolve_model

    if args.model is None or args.config is None:
        missing = " and ".join(
            o for o, v in (("--model", args.model), ("--config", args.config)) if v is None
        )
        raise ConfigError(
            f"--training needs {missing}: the model (HF folder or config.json) and the training config "
            "(as tiered finetune takes them)"
        )
    if not Path(args.config).is_file():
        raise ConfigError(
            f"--config {args.config}: no such file; pass the DeepSpeed or tiered JSON you train with"
        )
    source = resolve_model(args.model)
    model = build_model(source, meta=True)
    cfg = load_config(args.config, model=model)
    return model, with_directory(cfg, Path(args.dir) if args.dir else None), source


def run_training(args: argparse.Namespace, out: TextIO) -> int:

    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    if args.dir is not None and not Path(args.dir).is_dir():
        raise ConfigError(
            f"--dir {args.dir}: not an existing directory; create it or pick the drive to measure"
        )
    model, cfg, source = load_model_and_config(args)
    from tiered.bench.progress import BenchProgress

    progress = BenchProgress(sys.stderr, quiet=bool(args.quiet))
    try:
        return _run(args, out, model, cfg, source, progress)
    finally:
        progress.close()


def _run(args: argparse.Namespace, out: TextIO, model: Any, cfg: Any, source: Any, progress: Any) -> int:
    from tiered.bench.training import bench_training

    doc: dict[str, Any] = {}
    status = 0
    if args.tune:
        from tiered.bench.tune import tune_training

        tuned = tune_training(
            model,
            cfg,
            steps=args.steps,
            warmup=args.warmup,
            compute_s=args.compute_s or 0.0,
            progress=progress,
        )
        out.write(tuned.to_markdown())
        tuned.write_fragment(Path(args.tune))
        out.write(f"\nconfig fragment written to {args.tune}\n")
        doc["tune"] = tuned.to_json()
        cfg = tuned.best_config
    if args.check:
        from tiered.bench.training_check import check_round_robin
        from tiered.finetune.model import build_model

        check = check_round_robin(
            model,
            lambda: build_model(source),
            cfg,
            steps=args.steps,
            warmup=args.warmup,
            seq_len=args.seq_len,
            compute_s=args.compute_s,
            progress=progress,
        )
        out.write(check.prediction.to_markdown())
        doc["training"] = check.prediction.to_json()
        out.write("\n" + check.to_markdown())
        doc["check"] = check.to_json()
        if not check.ok:
            print(
                "tiered bench: the prediction is off by more than 20% on some link (see the table)",
                file=sys.stderr,
            )
            status = 1
    else:
        result = bench_training(
            model,
            cfg,
            steps=args.steps,
            warmup=args.warmup,
            compute_s=args.compute_s or 0.0,
            progress=progress,
        )
        out.write(result.to_markdown())
        doc["training"] = result.to_json()
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        out.write(f"\nJSON written to {args.json}\n")
    return status
