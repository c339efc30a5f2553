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

from tiered.errors import ConfigError

DESCRIPTION = """\
Fine-tune a causal language model on a plain text file through tiered's engine (ZeRO-3, with
parameters, gradients and optimizer state placed by the config: GPU, pinned CPU or NVMe).

--model is a local Hugging Face folder (config.json, optionally *.safetensors weights and
tokenizer files) or a bare config.json: the model is built from the config, nothing is downloaded;
safetensors weights in the folder are loaded. Without tokenizer files the text is tokenized with
the built-in byte tokenizer (token id = UTF-8 byte value, 0..255; needs vocab_size >= 256).
--config is a DeepSpeed ds_config.json (used unchanged) or a tiered config. Prints the loss every
--log-every steps, tokens/s, and at the end the bytes moved per link, GB/s, stall time and peak
resident bytes per tier. Ctrl-C stops cleanly after closing the engine (exit status 130).
"""

EPILOG = """\
examples:
  tiered finetune --model examples/tiny-llama --config examples/ds_config.json \\
      --data examples/corpus.txt --steps 20 --nvme-path /mnt/nvme0/tiered
  tiered finetune --model ./my-llama --config ds_config.json --data train.txt \\
      --seq-len 512 --batch-size 4 --lr 1e-5 --stats-json stats.json --compare-torch

A step is one optimizer step (gradient_accumulation_steps micro-batches of --batch-size rows).
exit status: 0 done, 2 bad input (one line on stderr naming the file or key), 130 interrupted.
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
    p.add_argument("--data", required=True, metavar="FILE", help="plain UTF-8 text file to train on")
    p.add_argument("--seq-len", type=int, default=128, metavar="N", help="tokens per row (default 128)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        metavar="N",
        help="rows per micro-batch (default: train_micro_batch_size_per_gpu of the config, else 1)",
    )
    p.add_argument("--steps", type=int, default=10, metavar="N", help="optimizer steps (default 10)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (overrides optimizer.params.lr)")
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


def finetune_job(
    *,
    model_path: str | Path,
    config: str | Path | dict[str, Any],
    data_path: str | Path,
    seq_len: int = 128,
    batch_size: int | None = None,
    steps: int = 10,
    lr: float | None = None,
    seed: int = 0,
    log_every: int = 1,
    nvme_path: str | None = None,
    compare_torch: bool = False,
    out: TextIO | None = None,
) -> JobResult:
    """Build, train, print progress and stats to `out`; see the module doc. Raises ConfigError
    (a TieredError) naming the path or key on bad input, before anything trains."""
    import torch

    from tiered.config.loader import load_config, read_config_file
    from tiered.finetune import (
        TrainOptions,
        apply_overrides,
        batches,
        build_model,
        load_tokens,
        max_rel_diff,
        reference_train,
        resolve_model,
        tier_table,
        tokenizer_for,
        train,
    )
    from tiered.finetune.loop import micro_batch_size

    out = out or sys.stdout
    w = out.write
    opts = TrainOptions(steps=steps, log_every=log_every)
    source = resolve_model(model_path)
    if isinstance(config, dict):
        raw = config
    else:
        if not Path(config).is_file():
            raise ConfigError(
                f"--config {config}: no such file; pass a DeepSpeed ds_config.json or a tiered config"
            )
        raw = read_config_file(config)
    if not Path(data_path).is_file():
        raise ConfigError(f"--data {data_path}: no such file; pass a plain UTF-8 text file")
    raw = apply_overrides(raw, lr=lr, batch_size=batch_size, nvme_path=nvme_path)

    model = build_model(source, seed=seed)
    hf: Any = model.config  # a transformers PretrainedConfig: its fields are per architecture
    vocab = int(hf.vocab_size)
    max_pos = getattr(hf, "max_position_embeddings", None)
    if isinstance(max_pos, int) and seq_len > max_pos:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings {max_pos}")
    tokenizer = tokenizer_for(source.folder, vocab)
    ids = load_tokens(data_path, tokenizer, vocab)
    cfg = load_config(raw, model=model)
    micro = micro_batch_size(cfg, batch_size)
    if compare_torch and cfg.precision.dtype != torch.float32:
        raise ConfigError(
            f"--compare-torch compares fp32 runs only, but --config {config if not isinstance(config, dict) else ''} "
            "enables bf16/fp16; drop --compare-torch or the bf16/fp16 section"
        )
    n_params = sum(p.numel() for p in model.parameters())
    w(
        f"model: {type(model).__name__} from {source.config_path}, {n_params:,} parameters"
        f"{' (weights from ' + str(len(source.weight_files)) + ' safetensors files)' if source.weight_files else ''}\n"
    )
    w(
        f"data: {data_path}, {ids.numel():,} tokens ({tokenizer.name} tokenizer); seq_len {seq_len}, "
        f"micro-batch {micro}, gradient accumulation {cfg.gradient_accumulation_steps}, {steps} steps\n"
    )
    z = cfg.zero
    w(
        f"placement: params on {z.offload_param.device if z.offload_param.device != 'none' else 'gpu'}, "
        f"optimizer state on {z.offload_optimizer.device if z.offload_optimizer.device != 'none' else 'gpu'}, "
        f"{str(cfg.precision.dtype).removeprefix('torch.')}; lr {cfg.optimizer.lr:g} ({cfg.optimizer.type})\n"
    )
    reference = copy.deepcopy(model) if compare_torch else None

    def on_log(s: Any) -> None:
        w(f"step {s.step:>5}/{steps}  loss {s.loss:.4f}  lr {s.lr:.3g}  {s.tokens_per_s:,.0f} tokens/s\n")
        out.flush()

    result = train(
        model,
        cfg,
        batches(ids, seq_len, micro, seed, source=str(data_path)),
        opts,
        on_log=on_log,
        keep_state=compare_torch,
    )
    if result.interrupted:
        w(f"interrupted after {result.steps_done} of {steps} steps; engine closed\n")
    w(
        f"\n{result.steps_done} steps, {result.tokens:,} tokens in {result.train_s:.2f} s: "
        f"{result.tokens_per_s:,.0f} tokens/s (engine set-up {result.init_s:.2f} s)\n"
    )
    if result.losses:
        w(f"loss: first {result.losses[0]:.4f}, last {result.losses[-1]:.4f}\n")
    w("\n" + tier_table(result.stats) + "\n")
    job = JobResult(result)
    if reference is not None and not result.interrupted:
        w(
            f"\nplain PyTorch ({'AdamW' if cfg.optimizer.adamw_mode else 'Adam'}, fp32), same data and init, "
            f"{result.steps_done} steps...\n"
        )
        t0 = time.perf_counter()
        ref_losses, ref_state = reference_train(
            reference, cfg, batches(ids, seq_len, micro, seed, source=str(data_path)), result.steps_done
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


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    _check_output(args.stats_json, "--stats-json")
    job = finetune_job(
        model_path=args.model,
        config=args.config,
        data_path=args.data,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        log_every=args.log_every,
        nvme_path=args.nvme_path,
        compare_torch=args.compare_torch,
        out=out,
    )
    if args.stats_json:
        doc = job.to_json()
        doc["args"] = {k: v for k, v in vars(args).items() if k not in ("run",)}
        _write_json(args.stats_json, doc)
        out.write(f"stats written to {args.stats_json}\n")
    return 130 if job.result.interrupted else 0
