"""Run under torchrun by tests/test_finetune_dist.py (not a test module itself).

`finetune OUT.pt ARGS...`: `tiered finetune ARGS...` through the CLI entry point, with the
training loop asked to keep the consolidated fp32 state, which rank 0 saves to OUT.pt.
`initialize OUT.json`: `tiered.initialize` on a small model without init_process_group; each rank
writes what the engine saw to OUT.json.rank<R>.
`cli PIDS ARGS...`: `tiered main ARGS...` as it is; each rank first writes its process id to
PIDS.rank<R> (the SIGTERM test signals the rank processes)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch


def finetune(out: str, argv: list[str]) -> int:
    import tiered.finetune as ft
    from tiered.cli.main import main

    inner = ft.train

    def keeping_state(*args: Any, **kwargs: Any) -> Any:
        result = inner(*args, **{**kwargs, "keep_state": True})
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save({"losses": list(result.losses), "state": result.state}, out)
        return result

    ft.train = keeping_state  # finetune_job imports train from tiered.finetune at call time
    return main(["finetune", *argv])


def cli(pids: str, argv: list[str]) -> int:
    from tiered.cli.main import main

    with open(f"{pids}.rank{os.environ.get('RANK', '0')}", "w", encoding="utf-8") as f:
        f.write(str(os.getpid()))
    return main(argv)


def initialize(out: str) -> int:
    import torch.distributed as dist

    import tiered

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3},
    }
    with tiered.initialize(model, cfg) as engine:
        seen = {
            "initialized": dist.is_initialized(),
            "backend": str(dist.get_backend()),
            "world_size": engine.world_size,
            "rank": engine.rank,
        }
    with open(f"{out}.rank{seen['rank']}", "w", encoding="utf-8") as f:
        json.dump(seen, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    mode, target, *rest = sys.argv[1:]
    if mode == "finetune":
        sys.exit(finetune(target, rest))
    sys.exit(cli(target, rest) if mode == "cli" else initialize(target))
