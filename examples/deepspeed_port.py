"""A DeepSpeed training script, ported to tiered by changing one import.

The original read ``import deepspeed``; everything below it is DeepSpeed's API as scripts use it:
``deepspeed.initialize(args=..., model=..., model_parameters=..., optimizer=..., lr_scheduler=...,
training_data=...)`` returning ``(engine, optimizer, dataloader, lr_scheduler)``, no-decay param
groups, ``engine.backward`` / ``engine.step`` per micro-batch, ``save_checkpoint`` and a 16-bit
export. It trains the tiny Llama of examples/tiny-llama (random init) on examples/corpus.txt as
bytes:

    python examples/deepspeed_port.py --deepspeed_config my_ds_config.json --steps 20 --out run/

With no --deepspeed_config it writes a small one (ZeRO-3, parameters and optimizer state offloaded
to CPU, no optimizer section: the script's AdamW is the optimizer, as HF-style scripts do).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, get_linear_schedule_with_warmup

import tiered.deepspeed as deepspeed  # was: import deepspeed

HERE = Path(__file__).resolve().parent
log = logging.getLogger("deepspeed_port")

DEFAULT_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
        "sub_group_size": 200000,
    },
}


class ByteChunks(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """The corpus as bytes (the tiny Llama's vocabulary is 256), cut into equal chunks."""

    def __init__(self, path: Path, length: int) -> None:
        data = torch.tensor(list(path.read_bytes()), dtype=torch.long)
        n = len(data) // length
        self.chunks = data[: n * length].view(n, length)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.chunks[i], "labels": self.chunks[i].clone()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--local_rank", type=int, default=-1, help="set by the launcher (unused: LOCAL_RANK)")
    p.add_argument(
        "--deepspeed_config", default=None, help="a DeepSpeed JSON; default: a small CPU-offload one"
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.0, help="for weights (biases and norms: none)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--out", default="deepspeed_port_out", help="checkpoints and the exported model")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[float]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    if args.deepspeed_config is None:
        fd, path = tempfile.mkstemp(suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(DEFAULT_CONFIG, fh)
        args.deepspeed_config = path
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(HERE / "tiny-llama"))

    # the usual no-decay groups: biases and norm weights get no weight decay
    no_decay = ("bias", "norm")
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=args.steps)
    data = ByteChunks(HERE / "corpus.txt", args.seq_len)

    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, lr_scheduler=scheduler, training_data=data
    )
    losses: list[float] = []
    engine.train()
    with engine:
        while engine.global_steps < args.steps:
            for batch in loader:
                batch = {k: v.to(engine.device) for k, v in batch.items()}
                loss = engine(**batch).loss
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
                if engine.was_step_applied():
                    log.info(
                        "step %d  loss %.4f  lr %.2e  grad norm %.3f",
                        engine.global_steps,
                        losses[-1],
                        scheduler.get_last_lr()[0],
                        engine.get_global_grad_norm(),
                    )
                if engine.global_steps >= args.steps:
                    break
        engine.save_checkpoint(os.path.join(args.out, "checkpoints"))
        engine.save_16bit_model(os.path.join(args.out, "model"))
    return losses


if __name__ == "__main__":
    main()
