"""The option groups of `tiered finetune` (data, model, checkpoints, trace and plot) and the
frozen objects they build (`FinetuneOptions`, `CheckpointOptions`); tiered/cli/finetune/command.py
wires them into the command."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tiered.errors import ConfigError


@dataclass(frozen=True)
class CheckpointOptions:
    """--out and the checkpoint options ([Note: run directory]); the job builds its
    CheckpointPolicy from them. `temporary`: the run folder is removed after the job (the demo),
    so no line that loads the export is printed."""

    out_dir: Path
    save_every: int | None = None
    keep_last: int | None = None
    resume: str | None = None
    save_on_interrupt: bool = True
    merge_lora: bool = False
    overwrite: bool = False
    temporary: bool = False


@dataclass(frozen=True)
class FinetuneOptions:
    """Everything one `tiered finetune` run is told (the command's options, or the demo's
    choices); `finetune_job` reads it and changes nothing in it. `free_memory` overrides the
    measured free memory of the compute device (bytes, what it is) for the activation check."""

    model_path: str | Path
    config: str | Path | dict[str, Any] | None
    """None: planned from this machine ([Note: the machine is the default])."""
    data_path: str | Path
    seq_len: int = 128
    batch_size: int | None = None
    steps: int = 10
    lr: float | None = None
    weight_decay: float | None = None
    warmup_steps: int | None = None
    seed: int = 0
    log_every: int = 1
    nvme_path: str | None = None
    compare_torch: bool = False
    text_field: str = "text"
    eval_fraction: float | None = None
    eval_data: str | Path | None = None
    eval_every: int | None = None
    lora: str | None = None
    gradient_checkpointing: bool = False
    gradient_checkpointing_reentrant: bool = False
    free_memory: tuple[int, str] | None = None
    trace_path: str | Path | None = None
    plot_path: str | Path | None = None
    checkpoints: CheckpointOptions | None = None
    auto_config: str | None = None
    """``--auto-config key=value,...``: sets tiered.auto_config ([Note: auto config])."""

    @property
    def config_name(self) -> str:
        """How the refusals name the config: its file, or "the config" for a dict."""
        if self.config is None:
            return "the config planned from this machine"
        return "the config" if isinstance(self.config, dict) else f"--config {self.config}"

    @staticmethod
    def from_args(args: argparse.Namespace) -> FinetuneOptions:
        """The options of a parsed `tiered finetune` command line."""
        return FinetuneOptions(
            model_path=args.model,
            config=args.config,
            data_path=args.data,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            steps=args.steps,
            lr=args.lr,
            weight_decay=args.weight_decay,
            warmup_steps=args.warmup_steps,
            seed=args.seed,
            log_every=args.log_every,
            nvme_path=args.nvme_path,
            compare_torch=args.compare_torch,
            text_field=args.text_field,
            eval_fraction=args.eval_fraction,
            eval_data=args.eval_data,
            eval_every=args.eval_every,
            lora=args.lora,
            gradient_checkpointing=args.gradient_checkpointing,
            gradient_checkpointing_reentrant=args.gradient_checkpointing_reentrant,
            trace_path=args.trace,
            plot_path=args.plot,
            checkpoints=checkpoint_options(args),
            auto_config=args.auto_config,
        )


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
        "--overwrite",
        action="store_true",
        help="--out holds another run's checkpoints: delete them (and its DIR/final) and start afresh "
        "(without it such an --out is refused; --resume continues that run instead)",
    )
    g.add_argument(
        "--merge-lora",
        action="store_true",
        help="with --lora: also write the adapters merged into the base model to DIR/final/merged/",
    )


def checkpoint_options(args: argparse.Namespace) -> CheckpointOptions | None:
    """The CheckpointOptions of the options above, or None without --out (which they then need)."""
    if args.out is None:
        given = [
            flag
            for flag, v in (
                ("--save-every", args.save_every),
                ("--keep-last", args.keep_last),
                ("--resume", args.resume),
                ("--merge-lora", args.merge_lora or None),
                ("--overwrite", args.overwrite or None),
            )
            if v is not None
        ]
        if given:
            raise ConfigError(f"{', '.join(given)} needs --out DIR (where checkpoints and the model go)")
        return None
    if args.overwrite and args.resume is not None:
        raise ConfigError("--overwrite starts afresh and --resume continues: pass one of them")
    return CheckpointOptions(
        Path(args.out),
        save_every=args.save_every,
        keep_last=args.keep_last,
        resume=args.resume,
        save_on_interrupt=not args.no_save_on_interrupt,
        merge_lora=args.merge_lora,
        overwrite=args.overwrite,
    )


def checkpoint_policy(options: CheckpointOptions, *, model_folder: Path | None, lora: bool) -> Any:
    """The job's own CheckpointPolicy (it records what the run saved) for `options`. An --out
    holding another run's checkpoints is refused unless --resume or --overwrite: starting afresh
    beside them would let a later --resume continue the other run ([Note: run directory])."""
    from tiered.finetune.checkpointing import CheckpointPolicy

    policy = CheckpointPolicy(
        options.out_dir,
        save_every=options.save_every,
        keep_last=options.keep_last,
        resume=options.resume,
        save_on_interrupt=options.save_on_interrupt,
        merge_lora=options.merge_lora,
        lora=lora,
        model_folder=model_folder,
    )
    held = policy.checkpoints_dir
    # Dot-names are the save lock and interrupted saves' leftovers, not another run's checkpoints.
    holds = held.is_dir() and any(not p.name.startswith(".") for p in held.iterdir())
    if options.resume is None and not options.overwrite and holds:
        raise ConfigError(
            f"--out {options.out_dir}: {held} holds another run's checkpoints; pass --resume to "
            "continue that run, --overwrite to delete them and start afresh, or another --out"
        )
    return policy


def clear_for_overwrite(options: CheckpointOptions) -> None:
    """--overwrite: the earlier run's checkpoints and export go before this run saves its own."""
    import shutil

    from tiered.finetune.checkpointing import CHECKPOINTS, FINAL

    if not options.overwrite:
        return
    for name in (CHECKPOINTS, FINAL):
        path = options.out_dir / name
        if path.is_symlink():
            raise ConfigError(f"--overwrite: {path} is a symbolic link; tiered deletes only folders it wrote")
        if path.is_dir():
            shutil.rmtree(path)


def report_checkpoints(policy: Any, result: Any, out: TextIO, *, temporary: bool = False) -> None:
    """Where the run's checkpoints and model are, and the one line that loads the model."""
    w = out.write
    if policy.resumed_from:
        w(f"resumed from {policy.resumed_from}\n")
    if result.interrupted:
        if policy.saved:
            w(f"checkpoint saved: {policy.saved[-1]}; continue with the same command and --resume\n")
        return
    if temporary:
        w(
            f"model written to {policy.final_path} (a temporary folder, removed at the end; --out DIR keeps it)\n"
        )
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
