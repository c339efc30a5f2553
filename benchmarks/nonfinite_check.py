"""Cost of the non-finite check ([Note: non-finite steps]): the default ("raise") against the
exact oracle ("apply", nothing checked), side by side in one run on the same model and data.

Two engines on the same tiny Hugging Face Llama (bf16, parameters and optimizer offloaded to
"cpu", no clipping: the case where the check adds the per-flush gradient sums, since no norm is
computed), trained step by step in turn so drift of the machine hits both alike. Prints the
median and best step time of each, their ratios, the check's own work measured alone (a
per-flush sum, as on this device) as a share of the step, and whether both ended bitwise equal.

    python benchmarks/nonfinite_check.py [--hidden 256] [--layers 4] [--steps 8] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch


def _model(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def _config(policy: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
            "stage3_param_persistence_threshold": 0,
        },
        "tiered": {"nonfinite_step": policy},
    }


def _probe_cost(model: torch.nn.Module, *, repeats: int) -> float:
    """The check's own work per step, measured alone, as `GroupRuntime._probe` does it on this
    machine's compute device (no GPU here: a sum over the fp32 gradient home, one per flush;
    on CUDA a sum over the 16-bit incoming gradients), median seconds."""
    sizes = [p.numel() for p in model.parameters()]
    home = torch.randn(sum(sizes))
    got = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sums = [part.sum() for part in torch.split(home, sizes)]
        bool(torch.isfinite(torch.stack(sums)).all())
        got.append(time.perf_counter() - t0)
    return statistics.median(got)


def main() -> None:
    import tiered

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round and engine")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (4, args.seq), generator=g)
    engines = {p: tiered.initialize(_model(args.hidden, args.layers), _config(p)) for p in ("raise", "apply")}
    times: dict[str, list[float]] = {p: [] for p in engines}
    try:
        for e in engines.values():  # untimed: the trace, the kernels' first use
            e.backward(e(input_ids=ids, labels=ids).loss)
            e.step()
        for _ in range(args.rounds * args.steps):  # step by step, alternating
            for p, e in engines.items():
                t0 = time.perf_counter()
                e.backward(e(input_ids=ids, labels=ids).loss)
                e.step()
                times[p].append(time.perf_counter() - t0)
        sd = {p: e.state_dict_fp32() for p, e in engines.items()}
        equal = all(torch.equal(sd["raise"][k], v) for k, v in sd["apply"].items())
    finally:
        for e in engines.values():
            e.close(restore_weights=False)
    med = {p: statistics.median(t) for p, t in times.items()}
    best = {p: min(t) for p, t in times.items()}
    probe = _probe_cost(_model(args.hidden, args.layers), repeats=args.rounds * args.steps)
    out = {
        "model": f"llama hidden {args.hidden}, {args.layers} layers, batch 4 x {args.seq}, bf16, cpu offload",
        "median_step_s": med,
        "min_step_s": best,
        "ratio_raise_over_apply": med["raise"] / med["apply"],
        "ratio_raise_over_apply_min": best["raise"] / best["apply"],
        "probe_s_per_step": probe,
        "probe_share_of_apply_step": probe / best["apply"],
        "bitwise_equal": equal,
        "steps_each": len(times["raise"]),
    }
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
