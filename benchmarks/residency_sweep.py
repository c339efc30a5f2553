"""Issue 41's sweep: one model, one JSON, only the cpu tier's budget changed from the run's need
(no room for the optimizer state) to the need plus the whole state, and what the memory buys.

The model is an fp32 Llama (hidden 512, 6 layers, vocab 8192: 27.3M parameters); the JSON is
DeepSpeed's (ZeRO-3, parameters and gradients in cpu memory, ``offload_optimizer.device: nvme``,
sub_group_size 1e6; batch 1 x 64 tokens, so the step is I/O-bound where the state is on NVMe) with
``tiered.tiers.cpu.budget`` set to need + f x state for f in --fractions.
Each budget trains --steps steps on the same batches (the first --warmup not timed) and reports:
NVMe bytes per step (read + write, from the tier manager's links, over the timed steps) next to
2 x max(0, state - room), the engine's own formula and `tiered plan`'s prediction for the config
(`tiered.planning.needs.predict` at that budget, [Note: residency]), the measured s/step next to
the plan's (the same time model as `tiered plan`: [Note: step time model], the compute timed on
the model's own layer as `tiered plan --model` does), and the losses (bitwise equal across budgets
or the run fails).

    python benchmarks/residency_sweep.py [--steps 6] [--bandwidth bench.json] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BATCH, SEQ = 1, 64
"""Few tokens a step, so the optimizer state's NVMe traffic is a large share of it (a 27M-parameter
model's state is 24 B x 27M = 0.66 GB of reads and writes against ~10 GFLOP of compute)."""


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def config(nvme_dir: str, cpu_budget: int | None, residency: str = "auto") -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme_dir,
                "pin_memory": True,
                "buffer_count": 2,
            },
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": 1_000_000,
        },
        "aio": {"block_size": 1_048_576, "queue_depth": 8, "thread_count": 1},
        "tiered": {"residency": residency},
    }
    if cpu_budget is not None:
        cfg["tiered"]["tiers"] = {"cpu": {"budget": int(cpu_budget)}}
    return cfg


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 8192, (BATCH, SEQ), generator=g) for _ in range(n)]


def state_and_need(base: Path) -> tuple[int, int]:
    import tiered

    with tiered.initialize(build_model(), config(str(base / "probe"), None, residency="off")) as e:
        state = sum(p.nbytes for p in e.tm.partitions() if p.home == "nvme")
        return state, int(e.capacity["cpu"]["total"])


def timed_steps(
    e: Any, steps: int, warmup: int
) -> tuple[list[float], list[float], dict[str, dict[str, float]]]:
    """`steps` steps of `e` on `batches`: each step's seconds, each loss, and the tier manager's
    link bytes over the steps after the first `warmup` (writes and prefetches settled at both
    ends, so a window holds exactly its steps' moves)."""

    def settled_links() -> dict[str, Any]:
        e.optimizer.wait_writes()
        e.zero.wait_prefetches()
        return e.tm.stats()["links"]

    times, losses = [], []
    first: dict[str, Any] = {}
    for i, x in enumerate(batches(steps)):
        if i == warmup:
            first = settled_links()
        t0 = time.perf_counter()
        out = e(input_ids=x, labels=x)
        e.backward(out.loss)
        e.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(out.loss.detach()))
    links = settled_links()
    window = {k: {"bytes": v["bytes"] - first.get(k, {"bytes": 0})["bytes"]} for k, v in links.items()}
    return times, losses, window


def train(cfg: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    import tiered
    from tiered.planning.traffic import measured_per_step

    with tiered.initialize(build_model(), cfg) as e:
        times, losses, window = timed_steps(e, steps, warmup)
        measured = measured_per_step(window, e.parts.tier_memory, steps - warmup)
        s = e.stats()
    return {
        "step_s": statistics.median(times[warmup:]),
        "losses": losses,
        "nvme_bytes_per_step": measured["disk->host"] + measured["host->disk"],
        "formula_nvme_bytes_per_step": s["bytes_per_step"]["formula"]["disk->host"]
        + s["bytes_per_step"]["formula"]["host->disk"],
        "kept_state_bytes": s["residency"]["cpu"]["state"],
        "kept_evictions": s["tiers"]["kept_evictions"],
        "peak_rss_bytes": s["host_memory"]["peak_rss_bytes"],
    }


def predicted(cfg_raw: dict[str, Any], bw: dict[str, float]) -> dict[str, float]:
    from tiered.config.loader import load_config
    from tiered.planning.needs import predict
    from tiered.planning.timing import config_seconds_per_step

    model = build_model()
    cfg = load_config(cfg_raw, model=model)
    pred = predict(model, cfg, gpu_is_host=True, device_kind="cpu")
    flops = 6 * sum(p.numel() for p in model.parameters()) * BATCH * SEQ
    step = config_seconds_per_step(pred, cfg, bw, compute_flops=flops, shared_cores=True)
    return {
        "step_s": step.seconds,
        "nvme_bytes_per_step": step.traffic["disk->host"] + step.traffic["host->disk"],
        "kept_state_bytes": pred.residency.bytes_in("cpu", "state"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--bandwidth", help="tiered bench --json output (default: the plan's assumed bandwidths)")
    ap.add_argument("--dir", help="where the NVMe files go (default: a temporary folder)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    from tiered.planning.compute_probe import probe_model_compute
    from tiered.planning.timing import DEFAULT_BANDWIDTH, compute_threads_beside_engine, read_bandwidth

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    bw = dict(DEFAULT_BANDWIDTH)
    if args.bandwidth:
        bw, _ = read_bandwidth(args.bandwidth)
    model = build_model()
    probe = probe_model_compute(
        model.config, micro_batch=BATCH, seq_len=SEQ, threads=compute_threads_beside_engine()
    )
    bw["flops"] = 6 * sum(p.numel() for p in model.parameters()) * BATCH * SEQ / probe.step_seconds()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        base = Path(d)
        state, need = state_and_need(base)
        rows = []
        for f in args.fractions:
            room = int(f * state)
            cfg = config(str(base / f"f{f}"), need + room)
            run = train(cfg, args.steps, args.warmup)
            plan = predicted(cfg, bw)
            rows.append({"fraction": f, "room_bytes": room, "ideal_nvme_bytes_per_step": 2 * max(0, state - room),
                         "measured": run, "plan": plan})  # fmt: skip
            print(
                f"room {f:>4.0%} of the state: NVMe {run['nvme_bytes_per_step'] / 1e6:8.2f} MB/step "
                f"(2 x (state - room) {2 * max(0, state - room) / 1e6:8.2f}, plan {plan['nvme_bytes_per_step'] / 1e6:8.2f}); "
                f"{run['step_s']:.3f} s/step (plan {plan['step_s']:.3f}, plan/measured "
                f"{plan['step_s'] / run['step_s']:.2f})",
                flush=True,
            )
    same = all(r["measured"]["losses"] == rows[0]["measured"]["losses"] for r in rows)
    out = {
        "model_params": sum(p.numel() for p in model.parameters()),
        "state_bytes": state,
        "cpu_need_bytes": need,
        "bandwidth": bw,
        "compute_probe": probe.describe(),
        "losses_identical": same,
        "rows": rows,
    }
    print(
        f"state {state / 1e6:.1f} MB, cpu need {need / 1e6:.1f} MB; losses identical at every budget: {same}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
