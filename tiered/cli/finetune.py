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
from typing import Any, TextIO

from tiered.cli.finetune_options import (
    add_checkpoint_arguments,
    add_data_arguments,
    add_model_arguments,
    add_observability_arguments,
    checkpoint_policy,
    report_checkpoints,
)
from tiered.errors import ConfigError

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


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
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

    result: Any  # tiered.finetune.TrainResult
    reference_losses: tuple[float, ...] | None = None
    max_rel_diff: float | None = None
    max_rel_param: str | None = None

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


def _check_output(path: str | None, option: str) -> None:
    if path is None:
        return
    parent = Path(path).resolve().parent
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


def finetune_job(
    *,
    model_path: str | Path,
    config: str | Path | dict[str, Any],
    data_path: str | Path,
    seq_len: int = 128,
    batch_size: int | None = None,
    steps: int = 10,
    lr: float | None = None,
    weight_decay: float | None = None,
    warmup_steps: int | None = None,
    seed: int = 0,
    log_every: int = 1,
    nvme_path: str | None = None,
    compare_torch: bool = False,
    out: TextIO | None = None,
    text_field: str = "text",
    eval_fraction: float | None = None,
    eval_data: str | Path | None = None,
    eval_every: int | None = None,
    lora: str | None = None,
    gradient_checkpointing: bool = False,
    gradient_checkpointing_reentrant: bool = False,
    free_memory: tuple[int, str] | None = None,
    trace_path: str | Path | None = None,
    plot_path: str | Path | None = None,
    checkpoint: Any = None,
) -> JobResult:
    """Build, train, print progress and stats to `out`; see the module doc. Raises ConfigError
    (a TieredError) naming the path or key on bad input, before anything trains. `free_memory`
    overrides the measured free memory of the compute device (bytes, what it is) for the
    activation check. `trace_path` / `plot_path`: --trace / --plot. Under torch.distributed
    each rank trains its slice of the global batch and only rank 0 writes to `out`, the trace
    and the plot ([Note: ranks in finetune]). `checkpoint` (a
    tiered.finetune.checkpointing.CheckpointPolicy) resumes, saves and exports the run
    ([Note: run directory])."""
    import contextlib
    import io

    import torch

    from tiered.config.hyper import check_complete
    from tiered.config.loader import load_config, read_config_file
    from tiered.finetune import (
        TrainOptions,
        apply_overrides,
        build_model,
        max_rel_diff,
        reference_train,
        resolve_model,
        tier_table,
        tokenizer_for,
        train,
    )
    from tiered.finetune.activations import check_activations, estimate_activations
    from tiered.finetune.loop import micro_batch_size
    from tiered.finetune.lora import parse_lora_spec
    from tiered.finetune.packing import eval_batches
    from tiered.finetune.progress import BarProgress, make_progress

    rank, world = _rank_world()
    out = out or sys.stdout
    if rank != 0:
        out = io.StringIO()  # only rank 0 prints ([Note: ranks in finetune])
    w = out.write
    opts = TrainOptions(steps=steps, log_every=log_every)
    if compare_torch and world > 1:
        raise ConfigError(
            f"--compare-torch runs the plain-PyTorch reference in one process, but WORLD_SIZE={world}: "
            "compare a 1-process run instead"
        )
    if plot_path is not None:
        _check_plot_available()
    source = resolve_model(model_path)
    if isinstance(config, dict):
        raw = config
    else:
        if not Path(config).is_file():
            raise ConfigError(
                f"--config {config}: no such file; pass a DeepSpeed ds_config.json or a tiered config"
            )
        raw = read_config_file(config)
    for option, path in (("--data", data_path), ("--eval-data", eval_data)):
        if path is not None and not Path(path).exists():
            raise ConfigError(
                f"{option} {path}: no such file or folder; pass a text/JSONL/parquet file, "
                "a folder of them or a saved Hugging Face dataset"
            )
    if eval_every is not None and eval_fraction is None and eval_data is None:
        raise ConfigError("--eval-every needs --eval-fraction or --eval-data (what to evaluate on)")
    if lora is not None:
        parse_lora_spec(lora)  # a malformed spec fails before the model is built
    raw = apply_overrides(raw, lr=lr, batch_size=batch_size, nvme_path=nvme_path)
    raw, trace_file, trace_is_temp = _with_trace(raw, trace_path, plot_path, rank)
    raw, hp = _hyperparameter_flags(raw, weight_decay=weight_decay, warmup_steps=warmup_steps, steps=steps)

    # streamed into the tiers from the shards ([Note: streaming load]) unless LoRA renames the
    # parameters or --compare-torch needs a real copy: those load the files into the model first
    streamed = source.folder if source.weight_files and lora is None and not compare_torch else None
    model = build_model(source, seed=seed, meta=streamed is not None)
    hf: Any = model.config
    vocab = int(hf.vocab_size)
    max_pos = getattr(hf, "max_position_embeddings", None)
    if isinstance(max_pos, int) and seq_len > max_pos:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings {max_pos}")
    tokenizer = tokenizer_for(source.folder, vocab)
    data = prepare_data(
        data_path=data_path,
        tokenizer=tokenizer,
        hf_config=hf,
        seq_len=seq_len,
        seed=seed,
        text_field=text_field,
        eval_fraction=eval_fraction,
        eval_data=eval_data,
    )
    model = prepare_model(
        model,
        lora=lora,
        gradient_checkpointing=gradient_checkpointing,
        reentrant=gradient_checkpointing_reentrant,
    )
    new_dirs = _missing_dirs(raw)
    try:  # validating the config creates nvme_path (as DeepSpeed does): undo that on a refusal
        cfg = load_config(raw, model=model, hyperparameters=hp)
        check_complete(cfg.unset, flags=_FLAGS)  # before anything is printed as if it were chosen
        micro = micro_batch_size(cfg, batch_size)
        if compare_torch and cfg.precision.dtype != torch.float32:
            raise ConfigError(
                f"--compare-torch compares fp32 runs only, but --config "
                f"{config if not isinstance(config, dict) else ''} enables bf16/fp16; drop --compare-torch or "
                "the bf16/fp16 section"
            )
        act = estimate_activations(
            hf, batch=micro, seq_len=seq_len, dtype=cfg.precision.dtype, checkpointing=gradient_checkpointing
        )
        check_activations(act, torch.device("cuda" if torch.cuda.is_available() else "cpu"), free_memory)
    except BaseException:
        _remove_empty(new_dirs)
        raise
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    w(
        f"model: {type(model).__name__} from {source.config_path}, {n_params:,} parameters"
        f"{f' ({n_train:,} trainable: LoRA {parse_lora_spec(lora).describe()})' if lora is not None else ''}"
        f"{' (weights from ' + str(len(source.weight_files)) + ' safetensors files)' if source.weight_files else ''}\n"
    )
    w(f"data: {data_path}, {data.summary}\n")
    w(
        f"batch: seq_len {seq_len}, micro-batch {micro}, gradient accumulation {cfg.gradient_accumulation_steps}, "
        f"{steps} steps; {act.describe()}"
        f"{'; gradient checkpointing' + (' (reentrant)' if gradient_checkpointing_reentrant else '') if gradient_checkpointing else ''}\n"
    )
    from tiered.engine.build import choose_placement  # the tiers the engine really uses

    w(
        f"placement: {choose_placement(cfg).describe(cfg)}, "
        f"{str(cfg.precision.dtype).removeprefix('torch.')}; lr {cfg.optimizer.lr:g} ({cfg.optimizer.type})\n"
    )
    reference = copy.deepcopy(model) if compare_torch else None

    held = data.eval
    eval_rows = held.rows if held is not None else 0
    if checkpoint is not None:
        checkpoint.model_folder = source.folder
        checkpoint.lora = lora is not None
        if compare_torch and checkpoint.resume is not None:
            raise ConfigError(
                "--compare-torch with --resume: the plain-PyTorch run starts from the initial weights; drop one"
            )
        if checkpoint.merge_lora and lora is None:
            raise ConfigError("--merge-lora needs --lora (there is no adapter to merge)")
    guard: Any = (
        checkpoint.stop
        if checkpoint is not None and checkpoint.save_on_interrupt
        else contextlib.nullcontext()
    )
    if world > 1:
        w(f"ranks: {world} (each trains {micro} of the {micro * world} rows of a global micro-batch)\n")
    progress = make_progress(out, steps)  # [Note: progress output]
    try:
        with guard:
            result = train(
                model,
                cfg,
                _rank_stream(data.train, micro, seed, rank, world),
                opts,
                on_log=progress.step,
                keep_state=compare_torch,
                eval_data=(lambda: eval_batches(held, micro)) if held is not None else None,
                eval_every=eval_every or steps,
                on_eval=lambda st, loss: progress.eval(st, loss, eval_rows),
                link_rates=isinstance(progress, BarProgress),
                trace_compute=trace_file is not None,
                weights=streamed,
                checkpoints=checkpoint,
            )
    finally:
        progress.close()
    if checkpoint is not None and checkpoint.merge_lora and not result.interrupted:
        w(f"merged model written to {checkpoint.export_merged(model)}\n")
    if result.interrupted:
        w(f"interrupted after {result.steps_done} of {steps} steps; engine closed\n")
    w(
        f"\n{result.steps_done} steps, {result.tokens:,} tokens in {result.train_s:.2f} s: "
        f"{result.tokens_per_s:,.0f} tokens/s (engine set-up {result.init_s:.2f} s)\n"
    )
    if result.losses:
        w(f"loss: first {result.losses[0]:.4f}, last {result.losses[-1]:.4f}\n")
    w("\n" + tier_table(result.stats) + "\n")
    if trace_file is not None:
        _report_trace(w, result, trace_file, trace_is_temp, plot_path)
    if checkpoint is not None:
        report_checkpoints(checkpoint, result, out)
    job = JobResult(result)
    if reference is not None and not result.interrupted:
        w(
            f"\nplain PyTorch ({'AdamW' if cfg.optimizer.adamw_mode else 'Adam'}, fp32), same data and init, "
            f"{result.steps_done} steps...\n"
        )
        t0 = time.perf_counter()
        ref_losses, ref_state = reference_train(
            reference, cfg, _train_stream(data.train, micro, seed), result.steps_done
        )
        ref_s = time.perf_counter() - t0
        diff, name = max_rel_diff(result.state or {}, ref_state)
        job = JobResult(result, tuple(ref_losses), diff, name)
        w(
            f"final loss: tiered {result.losses[-1]:.6f}, plain PyTorch {ref_losses[-1]:.6f} "
            f"(rel diff {abs(result.losses[-1] - ref_losses[-1]) / max(abs(ref_losses[-1]), 1e-12):.2e})\n"
        )
        w(f"max relative parameter difference: {diff:.2e} ({name})\n")
        w(
            f"plain PyTorch (everything in memory, no offload): {result.tokens / ref_s:,.0f} tokens/s "
            f"in {ref_s:.2f} s\n"
        )
    return job


def _missing_dirs(raw: dict[str, Any]) -> list[Path]:
    """The offload folders of `raw` (nvme_path) and their ancestors that do not exist yet, deepest first."""
    zero = raw.get("zero_optimization")
    found: list[Path] = []
    for key in ("offload_param", "offload_optimizer"):
        sec = zero.get(key) if isinstance(zero, dict) else None
        path = sec.get("nvme_path") if isinstance(sec, dict) else None
        if isinstance(path, str):
            p = Path(path).expanduser().absolute()
            while not p.exists() and p not in found:
                found.append(p)
                p = p.parent
    return sorted(found, key=lambda q: len(q.parts), reverse=True)


def _remove_empty(dirs: list[Path]) -> None:
    for d in dirs:
        try:
            d.rmdir()  # only if empty: never removes what someone else put there
        except OSError:
            pass


def _train_stream(rows: Any, micro: int, seed: int) -> Any:
    """The seeded packed-row stream ([Note: batch order and its state]); looked up at call time
    so tests can wrap it."""
    import tiered.finetune as ft

    return ft.PackedBatches(rows, micro, seed)


# The flag that supplies each hyper-parameter keyword (for "tiered never invents" errors).
_FLAGS = {
    "lr": "--lr",
    "weight_decay": "--weight-decay",
    "warmup_steps": "--warmup-steps",
    "total_steps": "--steps",
    "micro_batch_size": "--batch-size",
}


def _hyperparameter_flags(
    raw: dict[str, Any], *, weight_decay: float | None, warmup_steps: int | None, steps: int
) -> tuple[dict[str, Any], Any]:
    """Apply --weight-decay / --warmup-steps like --lr (they override a value the config gives),
    and --steps as total_num_steps where the config says "auto"; what the config leaves out goes
    to load_config as the caller's values ([Note: caller-supplied hyper-parameters])."""
    from tiered.config.hyper import Hyperparameters
    from tiered.config.values import is_auto

    raw = copy.deepcopy(raw)
    opt, sched = raw.get("optimizer"), raw.get("scheduler")
    opt_params = opt.get("params") if isinstance(opt, dict) else None
    sched_params = sched.get("params") if isinstance(sched, dict) else None
    if weight_decay is not None and isinstance(opt_params, dict):
        opt_params["weight_decay"] = weight_decay
        weight_decay = None
    if warmup_steps is not None and isinstance(sched_params, dict):
        sched_params["warmup_num_steps"] = max(1, warmup_steps)
        warmup_steps = None
    total = sched_params.get("total_num_steps") if isinstance(sched_params, dict) else None
    try:
        hp = Hyperparameters(
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            total_steps=steps if total is not None and is_auto(total) else None,
        )
    except ConfigError as exc:
        raise ConfigError(
            str(exc).replace("weight_decay=", "--weight-decay").replace("warmup_steps=", "--warmup-steps")
        ) from None
    return raw, hp


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
    raw: dict[str, Any], trace_path: str | Path | None, plot_path: str | Path | None, rank: int
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
        _check_output(getattr(args, option), "--" + option.replace("_", "-"))
    created = setup_distributed()
    try:
        return _run(args, out)
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()


def _run(args: argparse.Namespace, out: TextIO) -> int:
    rank, _ = _rank_world()
    policy = checkpoint_policy(args)
    job = finetune_job(
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
        out=out,
        checkpoint=policy,
        **_data_and_model_kwargs(args),
    )
    if args.stats_json and rank == 0:
        doc = job.to_json()
        doc["args"] = {k: v for k, v in vars(args).items() if k not in ("run",)}
        _write_json(args.stats_json, doc)
        out.write(f"stats written to {args.stats_json}\n")
    if job.result.interrupted and policy is not None and policy.stop.exit_signal is not None:
        return 128 + int(policy.stop.exit_signal)
    return 130 if job.result.interrupted else 0


def _data_and_model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """finetune_job's keywords from the options of `add_data_arguments` / `add_model_arguments`."""
    return {
        "text_field": args.text_field,
        "eval_fraction": args.eval_fraction,
        "eval_data": args.eval_data,
        "eval_every": args.eval_every,
        "lora": args.lora,
        "gradient_checkpointing": args.gradient_checkpointing,
        "gradient_checkpointing_reentrant": args.gradient_checkpointing_reentrant,
        "trace_path": args.trace,
        "plot_path": args.plot,
    }
