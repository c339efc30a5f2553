"""issue 36, the memory model on a scaled MoE: a Mixtral-shaped model (default 0.38B parameters,
8 experts, 6 layers) written as transformers 5 writes it (one bf16 tensor per expert, sharded,
with an index), planned by the search for the memories given, then streamed into the tiers
with the chosen config and trained; measured against the plan's figures, and the peak RSS while
loading against the largest fused tensor (an MoE layer's ``experts.gate_up_proj``).

    python benchmarks/moe_replica.py --dir DIR [--gpu-mem 1GiB] [--cpu-mem 2GiB] [--steps 3]
        [--seq 128] [--layers 6] [--experts 8] [--json F] [--weights FOLDER]

The same two fresh processes as benchmarks/headline_replica.py (whose child and report it runs):
the weights written a shard at a time (tiered.testing.weights: transformers' file layout), then
the search (what `tiered plan --model` runs), `tiered.from_pretrained` with its config, and the
steps. With no CUDA the gpu tier is host memory, so RSS is held against the plan's GPU + host
peaks. The work directory is removed at the end (unless --weights names a folder of yours).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from headline_replica import report, run_child  # the search, the load, the steps, the report

from tiered.units import parse_bytes


def moe_shape(a: argparse.Namespace) -> dict[str, int]:
    """The replica's sizes and parameter count (Mixtral's layout: gate_up [E, 2I, H], down [E, H, I])."""
    h, inter, e, kv = a.hidden, a.inter, a.experts, a.kv_heads * (a.hidden // a.heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * e * h * inter + e * h + 2 * h
    params = a.layers * per_layer + 2 * a.vocab * h + h
    return {
        "hidden": h,
        "inter": inter,
        "experts": e,
        "layers": a.layers,
        "heads": a.heads,
        "kv_heads": a.kv_heads,
        "vocab": a.vocab,
        "params": params,
        "fused_numel": e * 2 * inter * h,
    }


def write_weights(folder: Path, shape: dict[str, int]) -> None:
    code = (
        "import json, sys, torch\n"
        "from transformers import MixtralConfig\n"
        "from tiered.testing.weights import write_random_weights\n"
        "s = json.loads(sys.argv[1])\n"
        "cfg = MixtralConfig(vocab_size=s['vocab'], hidden_size=s['hidden'], intermediate_size=s['inter'],\n"
        "    num_hidden_layers=s['layers'], num_attention_heads=s['heads'], num_key_value_heads=s['kv_heads'],\n"
        "    num_local_experts=s['experts'], num_experts_per_tok=2, max_position_embeddings=4096,\n"
        "    tie_word_embeddings=False)\n"
        "write_random_weights(sys.argv[2], cfg, dtype=torch.bfloat16, shard_bytes=256 << 20)\n"
    )
    subprocess.run([sys.executable, "-c", code, json.dumps(shape), str(folder)], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dir", default=None, help="directory on the NVMe drive for every file (default: temp dir)"
    )
    p.add_argument("--gpu-mem", default="1GiB", help="GPU memory the plan may use (default 1GiB)")
    p.add_argument("--cpu-mem", default="2GiB", help="host memory the plan may use (default 2GiB)")
    p.add_argument("--nvme-mem", default="64GB")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=2048, help="each expert's intermediate size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=3, help="steps (the first not timed; default 3)")
    p.add_argument("--seq", type=int, default=128, help="tokens per step (default 128)")
    p.add_argument("--bandwidth", default=None, help="tiered bench --json output for the plan's time model")
    p.add_argument("--weights", default=None, help="a folder this script wrote before (not deleted)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be at least 2 (the first step is not timed)")
    shape = moe_shape(a)
    print(f"MoE replica: {json.dumps(shape)}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="tiered-moe-replica-", dir=a.dir))
    try:
        weights = Path(a.weights) if a.weights else work / "pretrained"
        if not a.weights:
            write_weights(weights, shape)
        files = sorted(weights.glob("*.safetensors"))
        (work / "swap").mkdir()
        spec = {
            "weights": str(weights),
            "nvme": str(work / "swap"),
            "gpu": parse_bytes(a.gpu_mem),
            "cpu": parse_bytes(a.cpu_mem),
            "nvme_mem": parse_bytes(a.nvme_mem),
            "steps": a.steps,
            "seq": a.seq,
            "bandwidth": a.bandwidth,
        }
        result = run_child(spec, "moe_replica")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["shape"], result["files"] = shape, [f.name for f in files]
    result["memories"] = {k: spec[k] for k in ("gpu", "cpu", "nvme_mem")}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(report(result))
    if result.get("fits"):
        m, fused = result["measured"], shape["fused_numel"]
        mib = 2**20
        print(
            f"largest fused tensor (experts.gate_up_proj, {fused:,} elements): {fused * 2 / mib:.0f} MiB in bf16, "
            f"{fused * 4 / mib:.0f} MiB in fp32; {len(files)} safetensors files, one tensor per expert"
        )
        if m.get("load_peak_rss") and m.get("rss_before_load"):
            grew = m["load_peak_rss"] - m["rss_before_load"]
            held = sum(v for t, v in m.get("load_tier_peaks", {}).items() if t in ("gpu", "cpu"))
            print(
                f"peak RSS while loading {m['load_peak_rss'] / mib:.0f} MiB: {grew / mib:.0f} MiB above the process "
                f"before the load, of which the gpu and cpu tiers' partitions {held / mib:.0f} MiB; the rest, "
                f"{(grew - held) / mib:.0f} MiB = {(grew - held) / (fused * 4):.2f} x the fused tensor in fp32"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
