"""`tiered finetune`: fine-tune a local Hugging Face causal LM with ZeRO-3 offload.

The work is in `tiered.finetune` (model, data, loop); this module parses options, prints the
progress and the tier stats, and writes the stats JSON. `finetune_job` is shared with the demo.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from tiered.cli.finetune_config import hyperparameter_flags, load_checked
from tiered.cli.finetune_options import (
    FinetuneOptions,
    add_checkpoint_arguments,
    add_data_arguments,
    add_model_arguments,
    add_observability_arguments,
    checkpoint_policy,
    clear_for_overwrite,
    report_checkpoints,
)
from tiered.errors import ConfigError

if TYPE_CHECKING:
    from tiered.finetune.checkpointing import CheckpointPolicy
    from tiered.finetune.loop import TrainResult

DESCRIPTION = """\
Fine-tune a causal language model through tiered's engine (ZeRO-3, with parameters, gradients
and optimizer state placed by the config: GPU, pinned CPU or NVMe), fully or with LoRA adapters.

--model is a local Hugging Face folder (config.json, optionally *.safetensors weights and
tokenizer files) or a bare config.json: the model is built from the config, nothing is downloaded;
safetensors weights in the folder are loaded. Without tokenizer files the text is tokenized with
the built-in byte tokenizer (token id = UTF-8 byte value, 0..255; needs vocab_size >= 256).
--config is a DeepSpeed ds_config.json (used unchanged) or a tiered config. Prints the loss every
--log-every steps, tokens/s, and at the end the bytes moved per link, GB/s, stall time and peak
resident bytes per tier. Ctrl-C stops cleanly after closing the engine (exit status 130); with
--out it first saves a checkpoint. --out DIR writes checkpoints and, at the end, the trained model
(DIR/final, loadable with AutoModelForCausalLM.from_pretrained; with --lora the adapter in peft's
format) and prints the line that loads it.

--data is a .txt file (one document), a .jsonl file (one document per row: the --text-field
string, or a chat "messages" list rendered with the tokenizer's chat template and trained on the
assistant turns only: every other token has label -100), a .parquet file, a folder saved by
Hugging Face datasets (save_to_disk), or a folder of such files (sorted by path). Packing: each
document ends with EOS; all are concatenated and cut into rows of --seq-len tokens, the last
partial row dropped; labels are not masked at document boundaries (as Hugging Face's run_clm and
TRL's packing). The row order is a permutation per epoch seeded by --seed. Before training, the
activations of one micro-batch (the Megatron estimate, see docs/finetune.md) are checked against
the compute device's free memory: a batch that cannot fit is refused with the numbers.
"""

EPILOG = """\
examples:
  tiered finetune --model examples/tiny-llama --config examples/ds_config.json \\
      --data examples/corpus.txt --steps 20 --nvme-path /mnt/nvme0/tiered
  tiered finetune --model ./my-llama --config ds_config.json --data train.txt \\
      --seq-len 512 --batch-size 4 --lr 1e-5 --stats-json stats.json --compare-torch
  tiered finetune --model ./my-llama --config ds_config.json --data chats.jsonl \\
      --lora r=16,alpha=32,dropout=0.05,targets=q_proj,k_proj,v_proj,o_proj \\
      --gradient-checkpointing --gradient-checkpointing-reentrant --eval-fraction 0.05 --eval-every 50

  tiered finetune --model ./my-llama --config ds_config.json --data train.txt --steps 1000 \\
      --out run --save-every 100 --keep-last 3          # later: the same command plus --resume

A step is one optimizer step (gradient_accumulation_steps micro-batches of --batch-size rows).
With --out, SIGINT/SIGTERM finish the step, save a checkpoint and exit (a second one exits at once).
exit status: 0 done, 2 bad input (one line on stderr naming the file or key), 130 interrupted
(SIGINT), 143 stopped by SIGTERM.
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "finetune",
        help="fine-tune a Hugging Face model with ZeRO-3 offload",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="PATH", help="local HF model folder or config.json")
    p.add_argument(
        "--config", required=True, metavar="JSON", help="DeepSpeed ds_config.json or tiered config"
    )
    p.add_argument(
        "--data",
        required=True,
        metavar="PATH",
        help="text/JSONL/parquet file, folder of them, or a saved HF dataset (see above)",
    )
    p.add_argument("--seq-len", type=int, default=128, metavar="N", help="tokens per row (default 128)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        metavar="N",
        help="rows per micro-batch (default: train_micro_batch_size_per_gpu of the config, else 1)",
    )
    p.add_argument("--steps", type=int, default=10, metavar="N", help="optimizer steps (default 10)")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help='learning rate (overrides optimizer.params.lr; required when the config has none or "auto")',
    )
    p.add_argument(
        "--weight-decay",
        type=float,
        default=None,
        help="AdamW weight decay (overrides optimizer.params.weight_decay; without it and without "
        "the key: none)",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        metavar="N",
        help="lr warmup steps (overrides scheduler.params.warmup_num_steps)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the model init and the batch order (default 0)")
    p.add_argument(
        "--log-every", type=int, default=1, metavar="N", help="print the loss every N steps (default 1)"
    )
    p.add_argument(
        "--nvme-path",
        default=None,
        metavar="DIR",
        help="overrides nvme_path of offload_param/offload_optimizer with device nvme",
    )
    p.add_argument(
        "--auto-config",
        default=None,
        metavar="SPEC",
        help="let the planner choose placement, sub_group_size, buffer_count and budgets for these memories: "
        "cpu_mem=64GB,gpu_mem=80GB[,nvme_mem=4TB,activation_mem=6GB,bandwidth=bench.json] "
        "(sets tiered.auto_config; [Note: auto config])",
    )
    p.add_argument("--stats-json", default=None, metavar="FILE", help="write losses and engine stats as JSON")
    p.add_argument(
        "--compare-torch",
        action="store_true",
        help="also run the same steps with plain PyTorch AdamW (fp32) and print the difference",
    )
    add_data_arguments(p)
    add_model_arguments(p)
    add_observability_arguments(p)
    add_checkpoint_arguments(p)
    return p


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
    if out_dir is not None and _inside(parent, Path(out_dir)):
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
    `options.checkpoints` the run resumes, saves and exports ([Note: run directory]); the job's
    CheckpointPolicy (what it saved, where the export went) is in the result."""
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
        _check_plot_available()
    source = resolve_model(o.model_path)
    policy = _checkpoint_policy(o, source.folder)
    raw, trace_file, trace_is_temp, hp = _job_config(o, rank)

    # streamed into the tiers from the shards ([Note: streaming load]) unless LoRA renames the
    # parameters or --compare-torch needs a real copy: those load the files into the model first
    streamed = source.folder if source.weight_files and o.lora is None and not o.compare_torch else None
    model = build_model(source, seed=o.seed, meta=streamed is not None)
    hf: Any = model.config
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
    cfg, micro, act = load_checked(o, raw, hp, model, hf)
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    w(
        f"model: {type(model).__name__} from {source.config_path}, {n_params:,} parameters"
        f"{f' ({n_train:,} trainable: LoRA {parse_lora_spec(o.lora).describe()})' if o.lora is not None else ''}"
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
                TrainOptions(steps=o.steps, log_every=o.log_every),
                on_log=progress.step,
                keep_state=o.compare_torch,
                eval_data=(lambda: eval_batches(held, micro)) if held is not None else None,
                eval_every=o.eval_every or o.steps,
                on_eval=lambda st, loss: progress.eval(st, loss, eval_rows),
                link_rates=isinstance(progress, BarProgress),
                trace_compute=trace_file is not None,
                weights=streamed,
                checkpoints=policy,
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
        _report_trace(w, result, trace_file, trace_is_temp, o.plot_path)
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


def _job_config(o: FinetuneOptions, rank: int) -> tuple[dict[str, Any], Path | None, bool, Any]:
    """The raw config with the command line applied (a copy: a dict in `o` is left as it is),
    the trace file (and whether it is temporary) and the caller's hyper-parameters; the input
    paths are checked first."""
    from tiered.config.loader import read_config_file
    from tiered.finetune import apply_overrides
    from tiered.finetune.lora import parse_lora_spec

    if isinstance(o.config, dict):
        raw = copy.deepcopy(o.config)
    else:
        if not Path(o.config).is_file():
            raise ConfigError(
                f"--config {o.config}: no such file; pass a DeepSpeed ds_config.json or a tiered config"
            )
        raw = read_config_file(o.config)
    for option, path in (("--data", o.data_path), ("--eval-data", o.eval_data)):
        if path is not None and not Path(path).exists():
            raise ConfigError(
                f"{option} {path}: no such file or folder; pass a text/JSONL/parquet file, "
                "a folder of them or a saved Hugging Face dataset"
            )
    if o.eval_every is not None and o.eval_fraction is None and o.eval_data is None:
        raise ConfigError("--eval-every needs --eval-fraction or --eval-data (what to evaluate on)")
    if o.lora is not None:
        parse_lora_spec(o.lora)  # a malformed spec fails before the model is built
    raw = apply_overrides(raw, lr=o.lr, batch_size=o.batch_size, nvme_path=o.nvme_path)
    out_dir = o.checkpoints.out_dir if o.checkpoints is not None else None
    raw, trace_file, trace_is_temp = _with_trace(raw, o.trace_path, o.plot_path, rank, out_dir)
    raw, hp = hyperparameter_flags(
        raw, weight_decay=o.weight_decay, warmup_steps=o.warmup_steps, steps=o.steps
    )
    return raw, trace_file, trace_is_temp, hp


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
        if path is not None and _inside(Path(path), o.checkpoints.out_dir):
            Path(path).resolve().parent.mkdir(parents=True, exist_ok=True)


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


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


def _check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib: pip install 'tiered[plot]' (or pip install matplotlib)"
        ) from None


def _with_trace(
    raw: dict[str, Any],
    trace_path: str | Path | None,
    plot_path: str | Path | None,
    rank: int,
    out_dir: Path | None = None,
) -> tuple[dict[str, Any], Path | None, bool]:
    """The config with tiered.trace_path set from --trace, else from the config's own
    trace_path, else (--plot alone) a hidden file next to the plot that the engine writes at
    close and `_report_trace` removes (only a name here: a refusal before training leaves
    nothing behind). Returns (config, trace file or None, whether it is temporary). Ranks other
    than 0 record no trace ([Note: ranks in finetune])."""
    import uuid

    raw = copy.deepcopy(raw)
    section = raw.get("tiered")
    if section is not None and not isinstance(section, dict):
        raise ConfigError('the config\'s "tiered" section must be a JSON object')
    own = section.get("trace_path") if isinstance(section, dict) else None
    if rank != 0:
        if isinstance(section, dict):
            section.pop("trace_path", None)
        return raw, None, False
    temp = False
    if trace_path is not None:
        path = Path(str(trace_path))
    elif isinstance(own, str):
        path = Path(own)
    elif plot_path is not None:
        path = Path(str(plot_path)).resolve().parent / f".trace-{uuid.uuid4().hex}.json"
        temp = True
    else:
        return raw, None, False
    # before the model is built ([Note: ranks in finetune]: rank 0 writes it); a folder inside
    # --out is the run's to create ([Note: run directory])
    if not temp and not (out_dir is not None and _inside(path, out_dir)):
        from tiered.engine.build import check_trace_path

        check_trace_path(path, "--trace" if trace_path is not None else "tiered.trace_path")
    raw.setdefault("tiered", {})["trace_path"] = str(path)
    return raw, path, temp


def _report_trace(w: Any, result: Any, trace_file: Path, temp: bool, plot_path: str | Path | None) -> None:
    """The per-lane table of the last step, the plot, and where the trace is."""
    from tiered.finetune.report import step_table

    try:
        trace = json.loads(trace_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--trace {trace_file}: the engine did not write a readable trace ({exc})"
        ) from None
    try:
        if result.steps_done:
            w("\n" + step_table(trace) + "\n")
        if plot_path is not None and result.steps_done:
            from tiered.finetune.plot import plot_run

            step = plot_run(plot_path, trace, result.losses, result.eval_losses, title="tiered finetune")
            w(f"plot of step {step} and the loss curve written to {plot_path}\n")
    finally:
        if temp:
            trace_file.unlink(missing_ok=True)
    if not temp:
        w(f"trace written to {trace_file} (open it in ui.perfetto.dev)\n")


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
