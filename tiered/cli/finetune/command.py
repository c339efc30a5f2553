"""`tiered finetune`'s job: the options applied, the model trained, the progress and the tier
stats printed, the stats JSON written.

The work is in `tiered.finetune` (model, data, loop); `finetune_job` is shared with the demo.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from tiered.cli.finetune.config import hyperparameter_flags, load_checked, with_auto_config
from tiered.cli.finetune.machine import describe_choice, describe_machine, machine_config
from tiered.cli.finetune.options import (
    FinetuneOptions,
    checkpoint_policy,
    clear_for_overwrite,
    report_checkpoints,
)
from tiered.cli.finetune.trace import check_plot_available, inside, report_trace, with_trace
from tiered.errors import ConfigError

if TYPE_CHECKING:
    from tiered.finetune.checkpointing import CheckpointPolicy
    from tiered.finetune.loop import TrainResult


@dataclass(frozen=True)
class JobResult:
    """What `finetune_job` did: the engine run and, with compare, the plain-PyTorch losses and
    the worst parameter difference (norm-relative)."""

    result: TrainResult
    reference_losses: tuple[float, ...] | None = None
    max_rel_diff: float | None = None
    max_rel_param: str | None = None
    checkpoints: CheckpointPolicy | None = None
    """The job's checkpoint policy (saved, resumed_from, stop), or None."""

    def to_json(self) -> dict[str, Any]:
        doc = self.result.to_json()
        if self.reference_losses is not None:
            doc["reference"] = {
                "optimizer": "torch.optim.AdamW",
                "losses": list(self.reference_losses),
                "final_loss": self.reference_losses[-1] if self.reference_losses else None,
                "max_rel_param_diff": self.max_rel_diff,
                "worst_param": self.max_rel_param,
            }
        return doc


def _check_output(path: str | None, option: str, out_dir: str | None = None) -> None:
    """The folder of an output file exists, or is inside --out (which the run creates)."""
    if path is None:
        return
    parent = Path(path).resolve().parent
    if out_dir is not None and inside(parent, Path(out_dir)):
        return
    if not parent.is_dir():
        raise ConfigError(
            f"{option} {path}: folder {parent} does not exist; create it or choose another path"
        )


@dataclass(frozen=True)
class PreparedData:
    """Packed training rows, optional eval rows, and a one-line summary."""

    train: Any  # tiered.finetune.packing.PackedRows
    eval: Any | None
    summary: str


def prepare_data(
    *,
    data_path: str | Path,
    tokenizer: Any,
    hf_config: Any,
    seq_len: int,
    seed: int,
    text_field: str = "text",
    eval_fraction: float | None = None,
    eval_data: str | Path | None = None,
) -> PreparedData:
    """Read, tokenize and pack the data, and split or read the eval rows ([Note: data formats],
    [Note: packing rule], [Note: batch order and its state]); every error names file and line."""
    from tiered.finetune.data_sources import load_documents
    from tiered.finetune.packing import pack, split_eval

    vocab = int(hf_config.vocab_size)
    eos = tokenizer.eos_token_id
    if eos is None and isinstance(getattr(hf_config, "eos_token_id", None), int):
        eos = int(hf_config.eos_token_id)
    docs = load_documents(data_path, tokenizer, vocab_size=vocab, eos_id=eos, text_field=text_field)
    rows = pack(docs, seq_len, str(data_path))
    held = None
    if eval_fraction is not None:
        rows, held = split_eval(rows, eval_fraction, seed)
    elif eval_data is not None:
        held = pack(
            load_documents(eval_data, tokenizer, vocab_size=vocab, eos_id=eos, text_field=text_field),
            seq_len,
            str(eval_data),
        )
    eos_text = f"EOS id {eos}" if eos is not None else "no EOS id (neither tokenizer nor config has one)"
    summary = (
        f"{rows.documents:,} documents, {rows.tokens:,} tokens ({tokenizer.name} tokenizer, {eos_text}); "
        f"{rows.rows:,} train rows of {seq_len}"
        f"{f', {rows.dropped} tail tokens dropped' if rows.dropped else ''}"
        f"{f', {held.rows:,} eval rows' if held is not None else ''}; "
        f"{rows.trained_label_fraction:.0%} of labels trained"
    )
    return PreparedData(rows, held, summary)


def prepare_model(model: Any, *, lora: str | None, gradient_checkpointing: bool, reentrant: bool) -> Any:
    """The model with LoRA adapters and gradient checkpointing as asked ([Note: LoRA through
    tiered], [Note: checkpointing and frozen parameters]); the spec is checked first."""
    from tiered.finetune.activations import enable_gradient_checkpointing
    from tiered.finetune.lora import apply_lora, parse_lora_spec

    if reentrant and not gradient_checkpointing:
        raise ConfigError("--gradient-checkpointing-reentrant needs --gradient-checkpointing")
    if lora is not None:
        model = apply_lora(model, parse_lora_spec(lora))
    if gradient_checkpointing:
        enable_gradient_checkpointing(model, reentrant=reentrant)
    return model


def finetune_job(options: FinetuneOptions, out: TextIO | None = None) -> JobResult:
    """Build, train, print progress and stats to `out`; see the module doc. Reads `options` and
    changes nothing in it. Raises ConfigError (a TieredError) naming the path or key on bad input,
    before anything trains. Under torch.distributed each rank trains its slice of the global batch
    and only rank 0 writes to `out`, the trace and the plot ([Note: ranks in finetune]). With
    `options.checkpoints` the run resumes, saves and exports ([Note: run directory]), holding the
    run folder's lock from first to last ([Note: one run per folder]); the job's CheckpointPolicy
    (what it saved, where the export went) is in the result."""
    with _run_lock(options):
        return _finetune_job(options, out)


def _run_lock(o: FinetuneOptions) -> Any:
    """Rank 0's lock of --out for the job ([Note: one run per folder]), taken before anything
    looks at the folder; the folder is checked (and created) first. A no-op without --out."""
    import contextlib

    from tiered.checkpoint.lock import RunLock
    from tiered.finetune.checkpointing import check_run_folder

    if o.checkpoints is None or _rank_world()[0] != 0:
        return contextlib.nullcontext()
    check_run_folder(o.checkpoints.out_dir)
    o.checkpoints.out_dir.mkdir(exist_ok=True)
    return RunLock(str(o.checkpoints.out_dir))


def _finetune_job(options: FinetuneOptions, out: TextIO | None) -> JobResult:
    import contextlib
    import io

    from tiered.finetune import TrainOptions, build_model, resolve_model, tier_table, tokenizer_for, train
    from tiered.finetune.lora import parse_lora_spec
    from tiered.finetune.packing import eval_batches
    from tiered.finetune.progress import BarProgress, make_progress

    o = options
    rank, world = _rank_world()
    out = out or sys.stdout
    if rank != 0:
        out = io.StringIO()  # only rank 0 prints ([Note: ranks in finetune])
    w = out.write
    if o.compare_torch and world > 1:
        raise ConfigError(
            f"--compare-torch runs the plain-PyTorch reference in one process, but WORLD_SIZE={world}: "
            "compare a 1-process run instead"
        )
    if o.plot_path is not None:
        check_plot_available()
    source = resolve_model(o.model_path)
    policy = _checkpoint_policy(o, source.folder)
    raw, trace_file, trace_is_temp, hp, machine_said = _job_config(o, rank, world)

    # streamed into the tiers from the shards ([Note: streaming load]) unless LoRA renames the
    # parameters or --compare-torch needs a real copy: those load the files into the model first
    streamed = source.folder if source.weight_files and o.lora is None and not o.compare_torch else None
    model = build_model(source, seed=o.seed, meta=streamed is not None)
    from tiered.planning.text_model import describe_towers, loader_class_name, text_config_of

    hf: Any = text_config_of(
        model.config
    )  # a wrapped model's: [Note: wrapped models train their language model]
    if policy is not None:
        policy.model_class = loader_class_name(model)
    vocab = int(hf.vocab_size)
    max_pos = getattr(hf, "max_position_embeddings", None)
    if isinstance(max_pos, int) and o.seq_len > max_pos:
        raise ConfigError(f"--seq-len {o.seq_len} exceeds the model's max_position_embeddings {max_pos}")
    tokenizer = tokenizer_for(source.folder, vocab)
    data = prepare_data(
        data_path=o.data_path,
        tokenizer=tokenizer,
        hf_config=hf,
        seq_len=o.seq_len,
        seed=o.seed,
        text_field=o.text_field,
        eval_fraction=o.eval_fraction,
        eval_data=o.eval_data,
    )
    model = prepare_model(
        model,
        lora=o.lora,
        gradient_checkpointing=o.gradient_checkpointing,
        reentrant=o.gradient_checkpointing_reentrant,
    )
    if o.config is None:
        w(describe_machine(machine_said, o.auto_config))
    cfg, micro, act = load_checked(o, raw, hp, model, hf)
    if o.config is None:
        w(describe_choice(cfg))
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    w(
        f"model: {type(model).__name__} from {source.config_path}, {n_params:,} parameters"
        f"{f' ({n_train:,} trainable: LoRA {parse_lora_spec(o.lora).describe()})' if o.lora is not None else ''}"
        f"{f' ({n_train:,} trainable: {towers})' if (towers := describe_towers(model)) and o.lora is None else ''}"
        f"{' (weights from ' + str(len(source.weight_files)) + ' safetensors files)' if source.weight_files else ''}\n"
    )
    w(f"data: {o.data_path}, {data.summary}\n")
    w(
        f"batch: seq_len {o.seq_len}, micro-batch {micro}, gradient accumulation {cfg.gradient_accumulation_steps}, "
        f"{o.steps} steps; {act.describe()}"
        f"{'; gradient checkpointing' + (' (reentrant)' if o.gradient_checkpointing_reentrant else '') if o.gradient_checkpointing else ''}\n"
    )
    from tiered.engine.build import choose_placement  # the tiers the engine really uses

    w(
        f"placement: {choose_placement(cfg).describe(cfg)}, "
        f"{str(cfg.precision.dtype).removeprefix('torch.')}; lr {cfg.optimizer.lr:g} ({cfg.optimizer.type})\n"
    )
    reference = copy.deepcopy(model) if o.compare_torch else None

    held = data.eval
    eval_rows = held.rows if held is not None else 0
    guard: Any = policy.stop if policy is not None and policy.save_on_interrupt else contextlib.nullcontext()
    if world > 1:
        w(f"ranks: {world} (each trains {micro} of the {micro * world} rows of a global micro-batch)\n")
    if o.checkpoints is not None:
        clear_for_overwrite(o.checkpoints)  # every check passed: the earlier run's files go now
    _make_output_folders(o)
    progress = make_progress(out, o.steps)  # [Note: progress output]
    try:
        with guard:
            result = train(
                model,
                cfg,
                _rank_stream(data.train, micro, o.seed, rank, world),
                TrainOptions(
                    steps=o.steps,
                    log_every=o.log_every,
                    on_log=progress.step,
                    keep_state=o.compare_torch,
                    eval_data=(lambda: eval_batches(held, micro)) if held is not None else None,
                    eval_every=o.eval_every or o.steps,
                    on_eval=lambda st, loss: progress.eval(st, loss, eval_rows),
                    link_rates=isinstance(progress, BarProgress),
                    trace_compute=trace_file is not None,
                    weights=streamed,
                    checkpoints=policy,
                ),
            )
    finally:
        progress.close()
    if policy is not None and policy.merge_lora and not result.interrupted:
        w(f"merged model written to {policy.export_merged(model)}\n")
    if result.interrupted:
        w(f"interrupted after {result.steps_done} of {o.steps} steps; engine closed\n")
    w(
        f"\n{result.steps_done} steps, {result.tokens:,} tokens in {result.train_s:.2f} s: "
        f"{result.tokens_per_s:,.0f} tokens/s (engine set-up {result.init_s:.2f} s)\n"
    )
    if result.losses:
        w(f"loss: first {result.losses[0]:.4f}, last {result.losses[-1]:.4f}\n")
    w("\n" + tier_table(result.stats) + "\n")
    if trace_file is not None:
        report_trace(w, result, trace_file, trace_is_temp, o.plot_path)
    if policy is not None and o.checkpoints is not None:
        report_checkpoints(policy, result, out, temporary=o.checkpoints.temporary)
    job = JobResult(result, checkpoints=policy)
    if reference is not None and not result.interrupted:
        job = _compare_with_torch(w, job, reference, cfg, data.train, micro, o.seed)
    return job


def _checkpoint_policy(o: FinetuneOptions, model_folder: Path | None) -> Any:
    """The job's CheckpointPolicy, or None without checkpoint options; the combinations that
    cannot work are refused first."""
    if o.checkpoints is None:
        return None
    if o.compare_torch and o.checkpoints.resume is not None:
        raise ConfigError(
            "--compare-torch with --resume: the plain-PyTorch run starts from the initial weights; drop one"
        )
    if o.checkpoints.merge_lora and o.lora is None:
        raise ConfigError("--merge-lora needs --lora (there is no adapter to merge)")
    return checkpoint_policy(o.checkpoints, model_folder=model_folder, lora=o.lora is not None)


def _job_config(
    o: FinetuneOptions, rank: int, world: int
) -> tuple[dict[str, Any], Path | None, bool, Any, tuple[str, ...]]:
    """The raw config with the command line applied (a copy: a dict in `o` is left as it is),
    the trace file (and whether it is temporary) and the caller's hyper-parameters; the input
    paths are checked first."""
    from tiered.config.loader import read_config_file
    from tiered.config.overrides import apply_overrides
    from tiered.finetune.lora import parse_lora_spec

    machine_said: tuple[str, ...] = ()
    if o.config is None:  # [Note: the machine is the default]
        raw, machine_said = machine_config(o, world)
    elif isinstance(o.config, dict):
        raw = copy.deepcopy(o.config)
    else:
        if not os.path.lexists(o.config):
            raise ConfigError(
                f"--config {o.config}: no such file; pass a DeepSpeed ds_config.json or a tiered config"
            )
        raw = read_config_file(o.config, "--config")  # a regular file only ([Note: files a user names])
    for option, path in (("--data", o.data_path), ("--eval-data", o.eval_data)):
        if path is not None and not Path(path).exists():
            raise ConfigError(
                f"{option} {path}: no such file or folder; pass a text/JSONL/parquet file, "
                "a folder of them or a saved Hugging Face dataset"
            )
    if o.eval_every is not None and o.eval_fraction is None and o.eval_data is None:
        raise ConfigError("--eval-every needs --eval-fraction or --eval-data (what to evaluate on)")
    if o.eval_every is not None and o.eval_every < 1:
        raise ConfigError(f"--eval-every must be >= 1 (evaluate every N steps), got {o.eval_every}")
    if o.lora is not None:
        parse_lora_spec(o.lora)  # a malformed spec fails before the model is built
    raw = apply_overrides(raw, lr=o.lr, batch_size=o.batch_size, nvme_path=o.nvme_path)
    if o.auto_config is not None and o.config is not None:  # its syntax checked here, before the model
        raw = with_auto_config(raw, o.auto_config)
    out_dir = o.checkpoints.out_dir if o.checkpoints is not None else None
    raw, trace_file, trace_is_temp = with_trace(raw, o.trace_path, o.plot_path, rank, out_dir)
    raw, hp = hyperparameter_flags(
        raw, weight_decay=o.weight_decay, warmup_steps=o.warmup_steps, steps=o.steps
    )
    return raw, trace_file, trace_is_temp, hp, machine_said


def _compare_with_torch(
    w: Any, job: JobResult, reference: Any, cfg: Any, rows: Any, micro: int, seed: int
) -> JobResult:
    """The same steps with plain PyTorch AdamW from the same init and data, and the differences."""
    from tiered.finetune import max_rel_diff, reference_train

    result = job.result
    w(
        f"\nplain PyTorch ({'AdamW' if cfg.optimizer.adamw_mode else 'Adam'}, fp32), same data and init, "
        f"{result.steps_done} steps...\n"
    )
    t0 = time.perf_counter()
    ref_losses, ref_state = reference_train(
        reference, cfg, _train_stream(rows, micro, seed), result.steps_done
    )
    ref_s = time.perf_counter() - t0
    diff, name = max_rel_diff(result.state or {}, ref_state)
    w(
        f"final loss: tiered {result.losses[-1]:.6f}, plain PyTorch {ref_losses[-1]:.6f} "
        f"(rel diff {abs(result.losses[-1] - ref_losses[-1]) / max(abs(ref_losses[-1]), 1e-12):.2e})\n"
    )
    w(f"max relative parameter difference: {diff:.2e} ({name})\n")
    w(
        f"plain PyTorch (everything in memory, no offload): {result.tokens / ref_s:,.0f} tokens/s in {ref_s:.2f} s\n"
    )
    return JobResult(result, tuple(ref_losses), diff, name, checkpoints=job.checkpoints)


def _make_output_folders(o: FinetuneOptions) -> None:
    """The folders of --trace / --plot inside --out, which the run creates ([Note: run directory])."""
    if o.checkpoints is None:
        return
    for path in (o.trace_path, o.plot_path):
        if path is not None and inside(Path(path), o.checkpoints.out_dir):
            Path(path).resolve().parent.mkdir(parents=True, exist_ok=True)


def _train_stream(rows: Any, micro: int, seed: int) -> Any:
    """The seeded packed-row stream ([Note: batch order and its state]); looked up at call time
    so tests can wrap it."""
    import tiered.finetune as ft

    return ft.PackedBatches(rows, micro, seed)


def _write_json(path: str, doc: dict[str, Any]) -> None:
    def clean(x: Any) -> Any:  # JSON has no inf/nan
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    try:
        Path(path).write_text(json.dumps(clean(doc), indent=2, default=str) + "\n", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--stats-json {path}: cannot write ({exc.strerror or exc})") from None


def _rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def setup_distributed() -> bool:
    """Under torchrun (WORLD_SIZE > 1) set up the default process group from the environment
    ([Note: process group from torchrun]); True when this call created it (then `run`
    destroys it at the end)."""
    from tiered.engine.distributed import ensure_process_group

    return ensure_process_group()


def _rank_stream(rows: Any, micro: int, seed: int, rank: int, world: int) -> Any:
    """This rank's batches: rank r takes rows [r * micro, (r + 1) * micro) of each global
    micro-batch of micro * world rows of the seeded stream ([Note: ranks in finetune])."""
    stream = _train_stream(rows, micro * world, seed)
    if world == 1:
        return stream
    from tiered.finetune.ranks import RankSlice

    return RankSlice(stream, rank, world)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    for option in ("stats_json", "trace", "plot"):
        _check_output(getattr(args, option), "--" + option.replace("_", "-"), args.out)
    created = setup_distributed()
    try:
        return _run(args, out)
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()


def _run(args: argparse.Namespace, out: TextIO) -> int:
    rank, _ = _rank_world()
    job = finetune_job(FinetuneOptions.from_args(args), out)
    if args.stats_json and rank == 0:
        doc = job.to_json()
        doc["args"] = {k: v for k, v in vars(args).items() if k not in ("run",)}
        if job.checkpoints is not None:
            Path(args.stats_json).resolve().parent.mkdir(parents=True, exist_ok=True)  # inside --out
        _write_json(args.stats_json, doc)
        out.write(f"stats written to {args.stats_json}\n")
    policy = job.checkpoints
    skipped = int(job.result.stats.get("nonfinite_steps", 0) or 0)
    if skipped and rank == 0:
        # [Note: non-finite steps]: "skip" must not end a run that learnt nothing with status 0.
        applied = job.result.steps_done - skipped
        sys.stderr.write(
            f"tiered finetune: {skipped} of {job.result.steps_done} optimizer steps were skipped as "
            'non-finite (tiered.nonfinite_step = "skip")\n'
        )
        if applied <= 0 and not job.result.interrupted:
            sys.stderr.write(
                "error: no optimizer step was applied, so nothing was learnt and the saved model equals "
                "its start: look for NaN/inf in the model's weights or the data, or lower the learning "
                'rate; tiered.nonfinite_step = "raise" stops at the first such step\n'
            )
            return 3
    if job.result.interrupted and policy is not None and policy.stop.exit_signal is not None:
        return 128 + int(policy.stop.exit_signal)
    return 130 if job.result.interrupted else 0
