"""The option groups of `tiered finetune` (data, model, checkpoints, trace and plot) and the
objects they build; tiered/cli/finetune.py wires them into the command."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TextIO

from tiered.errors import ConfigError


def add_observability_arguments(p: argparse.ArgumentParser) -> None:
    """--trace and --plot ([Note: compute spans], [Note: step timeline plot])."""
    g = p.add_argument_group("trace and plot")
    g.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="write a Chrome-trace JSON (open it in ui.perfetto.dev or chrome://tracing) of module "
        "compute, the moves per link (NVMe reads and writes included) and the Adam per group; "
        "overrides tiered.trace_path of the config",
    )
    g.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw the timeline of the last step (compute, each link, Adam) and the loss curve "
        "(needs matplotlib: pip install 'tiered[plot]')",
    )


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    """--out and the checkpoint options ([Note: run directory], [Note: stop on a signal])."""
    g = p.add_argument_group("checkpoints and export")
    g.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="run folder: checkpoints in DIR/checkpoints/, the trained model in DIR/final/ "
        "(Hugging Face layout, with the tokenizer files)",
    )
    g.add_argument(
        "--save-every", type=int, default=None, metavar="N", help="save a checkpoint every N steps"
    )
    g.add_argument(
        "--keep-last",
        type=int,
        default=None,
        metavar="K",
        help="keep only the K newest checkpoints (older ones deleted once a newer one is complete)",
    )
    g.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="continue from the newest valid checkpoint under --out, or from PATH (a checkpoint folder)",
    )
    g.add_argument(
        "--no-save-on-interrupt",
        action="store_true",
        help="on SIGINT/SIGTERM stop without saving (default: finish the step, save, exit)",
    )
    g.add_argument(
        "--merge-lora",
        action="store_true",
        help="with --lora: also write the adapters merged into the base model to DIR/final/merged/",
    )


def checkpoint_policy(args: argparse.Namespace) -> Any:
    """The CheckpointPolicy of the options above, or None without --out (which they then need)."""
    from tiered.finetune.checkpointing import CheckpointPolicy

    if args.out is None:
        given = [
            flag
            for flag, v in (
                ("--save-every", args.save_every),
                ("--keep-last", args.keep_last),
                ("--resume", args.resume),
                ("--merge-lora", args.merge_lora or None),
            )
            if v is not None
        ]
        if given:
            raise ConfigError(f"{', '.join(given)} needs --out DIR (where checkpoints and the model go)")
        return None
    return CheckpointPolicy(
        Path(args.out),
        save_every=args.save_every,
        keep_last=args.keep_last,
        resume=args.resume,
        save_on_interrupt=not args.no_save_on_interrupt,
        merge_lora=args.merge_lora,
        lora=args.lora is not None,
    )


def report_checkpoints(policy: Any, result: Any, out: TextIO) -> None:
    """Where the run's checkpoints and model are, and the one line that loads the model."""
    w = out.write
    if policy.resumed_from:
        w(f"resumed from {policy.resumed_from}\n")
    if result.interrupted:
        if policy.saved:
            w(f"checkpoint saved: {policy.saved[-1]}; continue with the same command and --resume\n")
        return
    w(f"model written to {policy.final_path}; load it with:\n  {policy.load_line()}\n")


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """The data-format and eval options ([Note: data formats], [Note: packing rule])."""
    g = p.add_argument_group("data")
    g.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help='JSONL/parquet/dataset field holding the text (default "text")',
    )
    ev = g.add_mutually_exclusive_group()
    ev.add_argument(
        "--eval-fraction",
        type=float,
        default=None,
        metavar="F",
        help="hold out a seeded fraction F of the packed rows for eval",
    )
    ev.add_argument("--eval-data", default=None, metavar="PATH", help="eval data, in any --data format")
    g.add_argument(
        "--eval-every",
        type=int,
        default=None,
        metavar="K",
        help="eval loss every K steps and after the last (default: only after the last)",
    )


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """LoRA and gradient checkpointing ([Note: LoRA through tiered], [Note: activation estimate])."""
    g = p.add_argument_group("LoRA and memory")
    g.add_argument(
        "--lora",
        default=None,
        metavar="SPEC",
        help="train LoRA adapters only (peft), e.g. r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj; "
        "omitted keys take peft's defaults",
    )
    g.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each layer's activations in backward (Hugging Face's; non-reentrant)",
    )
    g.add_argument(
        "--gradient-checkpointing-reentrant",
        action="store_true",
        help="with --gradient-checkpointing: torch's reentrant variant (the default is non-reentrant)",
    )
