"""`tiered finetune`'s command line: its help text and options (the option groups are in
tiered/cli/finetune/options.py); `tiered.cli.finetune` runs what they ask."""

from __future__ import annotations

import argparse

from tiered.cli.finetune.options import (
    add_checkpoint_arguments,
    add_data_arguments,
    add_model_arguments,
    add_observability_arguments,
)

DESCRIPTION = """\
Fine-tune a causal language model through tiered's engine (ZeRO-3, with parameters, gradients
and optimizer state placed by the config: GPU, pinned CPU or NVMe), fully or with LoRA adapters.

--model is a local Hugging Face folder (config.json, optionally *.safetensors weights and
tokenizer files) or a bare config.json: the model is built from the config, nothing is downloaded;
safetensors weights in the folder are loaded. Without tokenizer files the text is tokenized with
the built-in byte tokenizer (token id = UTF-8 byte value, 0..255; needs vocab_size >= 256).
--config is a DeepSpeed ds_config.json (used unchanged) or a tiered config. Without --config the
run is planned from this machine: its GPU's free memory, the host's available memory less a
reserve for the system, the free space at --nvme-path (default ./tiered_offload), each overridden by
--auto-config; the fastest config that fits is trained (one block says what was read and chosen),
and --lr is required (no learning rate is chosen for you). Prints the loss every
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
  tiered finetune --model ./my-llama --data train.txt --lr 2e-5 --steps 100
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
        "--config",
        metavar="JSON",
        help="DeepSpeed ds_config.json or tiered config; left out, the run is planned from this machine's "
        "memories (GPU, host RAM less a reserve, free space at --nvme-path) and --lr is required",
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
