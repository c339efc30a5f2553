"""Issue 41's GPU-tier analogue of the cpu-budget sweep: the gpu tier's budget grown from the
working set to the working set plus every frozen parameter, and the host->"gpu" copies it saves.

The model is benchmarks/residency_sweep.py's fp32 Llama (27.3M parameters) with its MLPs frozen,
as a LoRA-style fine-tune's base is: never changed, so a copy held in "gpu" never needs a refresh
([Note: persistent by room]). The JSON: ZeRO-3, parameters and Adam state in cpu memory,
``stage3_param_persistence_threshold`` 0 and ``stage3_max_live_parameters`` the largest module (the embedding)
(each group released after use and gathered again in backward), only ``tiered.tiers.gpu.budget``
changed: need + f x frozen bytes for f in --fractions. On this machine the "gpu" tier is host
memory, so a gather is a memcpy counted on the cpu->gpu link: the bytes are what a GPU's PCIe
link would carry. Reports, per budget: the frozen bytes held persistent, cpu->gpu bytes per step
(measured over the timed steps), the s/step, and whether the losses are bitwise those of the
smallest budget.

    python benchmarks/gpu_room_sweep.py [--steps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import residency_sweep as rs

LAYER_NUMEL = 8192 * 512
"""The embedding's elements (the largest module; a decoder layer is 3.2M): a live budget that
releases each group after its use."""


def frozen_model() -> torch.nn.Module:
    model = rs.build_model()
    for name, p in model.named_parameters():
        if ".mlp." in name:
            p.requires_grad_(False)
    return model


def config(gpu_budget: int | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": rs.BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 1_000_000,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": LAYER_NUMEL,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        },
    }
    if gpu_budget is not None:
        cfg["tiered"] = {"tiers": {"gpu": {"budget": int(gpu_budget)}}}
    return cfg


def run(gpu_budget: int | None, steps: int, warmup: int) -> dict[str, Any]:
    import tiered

    with tiered.initialize(frozen_model(), config(gpu_budget)) as e:
        times, losses, window = rs.timed_steps(e, steps, warmup)
        copies = window["cpu->gpu"]["bytes"] / (steps - warmup)
        groups = e.zero.groups
        return {
            "step_s": statistics.median(times[warmup:]),
            "losses": losses,
            "cpu_to_gpu_bytes_per_step": copies,
            "frozen_held_bytes": sum(g.param.nbytes for g in groups if g.persistent and not g.trainable),
            "frozen_bytes": sum(g.param.nbytes for g in groups if not g.trainable),
            "need_bytes": int(e.capacity["gpu"]["total"])
            + max(0, LAYER_NUMEL * 4 - e.capacity["gpu"]["gather"]),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    base = run(None, 2, 1)  # the working set and the frozen bytes, at no budget
    rows = []
    for f in args.fractions:
        budget = base["need_bytes"] + int(f * base["frozen_bytes"])
        r = run(budget, args.steps, args.warmup)
        rows.append({"fraction": f, "gpu_budget_bytes": budget, **r})
        print(
            f"gpu room {f:>4.0%} of the frozen bytes: held {r['frozen_held_bytes'] / 1e6:7.2f} MB, "
            f"cpu->gpu {r['cpu_to_gpu_bytes_per_step'] / 1e6:8.2f} MB/step, {r['step_s']:.3f} s/step",
            flush=True,
        )
    same = all(r["losses"] == rows[0]["losses"] for r in rows)
    print(
        f"frozen {base['frozen_bytes'] / 1e6:.1f} MB, working set {base['need_bytes'] / 1e6:.1f} MB; "
        f"losses identical at every budget: {same}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "losses_identical": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
