"""issue 21, the headline's replica: the 36.3B / 128k-vocabulary Llama scaled by 1/--scale, its
memories scaled by the same factor, planned by the search and trained with the config it chose.

The headline is hidden 8192, 40 layers, intermediate 28672 (3.5x), 64 heads of 128 with 8 key/value
heads, vocabulary 128256 (15.66x hidden), untied, on an 80 GB GPU with 64 GB of host memory and
4 TB of NVMe. The replica keeps every ratio (intermediate / hidden, vocabulary / hidden, heads of
128, 8 query heads per key/value head, untied) at --hidden (default 2048) and takes the number of
layers that brings it closest to 36.3B / scale; its memories are 80 GB, 64 GB and 4 TB / scale.
At the default scale 20 that is 1.79B parameters: 28.7 GB of bf16 mixed-precision training state,
more than this machine's RAM.

    python benchmarks/headline_replica.py --dir DIR [--scale 20] [--steps 3] [--seq 128] [--json F]
        [--bandwidth bench.json] [--weights FOLDER]

Two fresh processes: (1) the "pretrained" folder (bf16 shards + index, written a shard at a time,
tiered.testing.weights; skipped with --weights); (2) the model on the meta device,
`tiered.planning.search.search` (what `tiered plan --model` and ``"auto_config"`` run) with the
scaled memories, this machine's device kind and the step's tokens, then `tiered.from_pretrained`
with the chosen config, --steps bf16 steps, and the measurements next to the plan's figures: peak
RSS (``ru_maxrss``; with no CUDA the gpu tier is host memory, so RSS is held against the plan's GPU +
host peaks), each tier's peak against its need, NVMe bytes per step (link counters after the first
step) against the formula, s/step against the prediction. The work directory is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiered.units import parse_bytes

HEADLINE = {
    "hidden": 8192,
    "layers": 40,
    "inter": 28672,
    "vocab": 128256,
    "gpu": 80e9,
    "cpu": 64e9,
    "nvme": 4e12,
}
HEADLINE_PARAMS = 36.3e9
HEAD_DIM = 128
Q_PER_KV = 8

_CHILD = r"""
import json, os, resource, sys, time
import torch
import tiered
from tiered.engine.pretrained import meta_causal_lm
from tiered.planning.candidate import Base
from tiered.planning.search import Memories, search
from tiered.planning.timing import DEFAULT_BANDWIDTH, read_bandwidth
spec = json.loads(sys.argv[1])
model = meta_causal_lm(spec["weights"], attn_implementation="sdpa")
base = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}}, "bf16": {"enabled": True},
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"nvme_path": spec["nvme"]},
                              "offload_param": {"nvme_path": spec["nvme"]}}}
bw = dict(DEFAULT_BANDWIDTH) if not spec["bandwidth"] else read_bandwidth(spec["bandwidth"])[0]
t0 = time.perf_counter()
res = search(model, Memories(int(spec["gpu"]), int(spec["cpu"]), int(spec["nvme_mem"])),
             nvme_path=spec["nvme"], bandwidth=bw, base=Base.read(base, model),
             device_kind="cuda" if torch.cuda.is_available() else "cpu",
             tokens_per_step=spec["seq"])
search_s = time.perf_counter() - t0
best = res.best
if best is None:
    print("RESULT " + json.dumps({"fits": False, "closest": res.closest.knobs if res.closest else None}))
    sys.exit(0)
del model
plan = {"knobs": best.knobs, "peaks": best.peaks, "traffic": best.traffic, "s_per_step": best.seconds_per_step,
        "needs": {t: d["total"] for t, d in best.prediction.needs.items()},
        "budgets": {t: s["budget"] for t, s in best.config["tiered"]["tiers"].items()}, "search_s": search_s,
        "config": best.config}
print("PLAN " + json.dumps(plan, default=str), flush=True)
def vm(key="VmHWM:"):
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key))
    except (OSError, StopIteration):
        return None
vm_hwm = vm
rss_before_load = vm("VmRSS:")
try:  # Linux: the high-water mark from here on is the load's (not the search's before it)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
t0 = time.perf_counter()
engine = tiered.from_pretrained(spec["weights"], best.config, attn_implementation="sdpa")
load_s = time.perf_counter() - t0
load_peak = vm_hwm()
load_tier_peaks = {t: d["peak_bytes"] for t, d in engine.stats()["tiers"]["tiers"].items()}
try:  # Linux: reset the high-water mark, so the steps' own peak is seen apart from the load's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
g = torch.Generator().manual_seed(1)
times, cpu_s, phases, losses, before = [], [], [], [], None
try:
    vocab = engine.module.config.vocab_size
    for i in range(spec["steps"]):
        ids = torch.randint(0, vocab, (1, spec["seq"]), generator=g)
        if i == 1:
            before = engine.stats()["tiers"]["links"]
        t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        loss = engine(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        phases.append({"forward": t1 - t0, "backward": t2 - t1, "step": t0 + times[-1] - t2})
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s.append(c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime)
        losses.append(float(loss))
        print(f"step {i + 1}: {times[-1]:.1f} s, loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    st = engine.stats()
finally:
    engine.close(restore_weights=False)
links = st["tiers"]["links"]
per = {k: (v["bytes"] - before.get(k, {}).get("bytes", 0)) / (spec["steps"] - 1) for k, v in links.items()}
meas = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "tier_peaks": {t: d["peak_bytes"] for t, d in st["tiers"]["tiers"].items()},
        "links_per_step": per,
        "nvme_read": sum(v for k, v in per.items() if k.startswith("nvme->")),
        "nvme_write": sum(v for k, v in per.items() if k.endswith("->nvme")),
        "s_per_step": sorted(times[1:])[len(times[1:]) // 2], "steps_s": times, "losses": losses,
        "cpu_s_per_step": cpu_s, "phases_s": phases, "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "formula": st["bytes_per_step"]["formula"], "host_memory": st.get("host_memory"), "load_s": load_s,
        "load_peak_rss": load_peak, "steps_peak_rss": vm_hwm(), "optimizer": st.get("optimizer"),
        "rss_before_load": rss_before_load, "load_tier_peaks": load_tier_peaks,
        "tier_counters": {k: v for k, v in st["tiers"].items() if k not in ("links", "tiers")}}
print("RESULT " + json.dumps({"fits": True, "plan": plan, "measured": meas}, default=str))
"""


def run_child(spec: dict[str, Any], who: str) -> dict[str, Any]:
    """`_CHILD` in a fresh process for `spec`: its RESULT (the plan and what was measured)."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)], stdout=subprocess.PIPE, text=True, check=False
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("RESULT ", "PLAN "))]
    if out.returncode != 0 or not lines or not lines[-1].startswith("RESULT "):
        print(out.stdout[-4000:])
        raise SystemExit(f"{who}: the training process failed (exit status {out.returncode})")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def replica_shape(scale: float, hidden: int) -> dict[str, int]:
    """The headline's ratios at `hidden`, with the layer count closest to 36.3B / scale."""
    r = hidden / HEADLINE["hidden"]
    heads = hidden // HEAD_DIM
    shape = {
        "hidden": hidden,
        "inter": int(round(HEADLINE["inter"] * r / 256)) * 256,
        "vocab": int(round(HEADLINE["vocab"] * r)),
        "heads": heads,
        "kv_heads": max(1, heads // Q_PER_KV),
    }
    kv = shape["kv_heads"] * HEAD_DIM
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * shape["inter"] + 2 * hidden
    rest = 2 * shape["vocab"] * hidden + hidden
    shape["layers"] = max(1, round((HEADLINE_PARAMS / scale - rest) / per_layer))
    shape["params"] = shape["layers"] * per_layer + rest
    return shape


def write_weights(folder: Path, shape: dict[str, int]) -> None:
    code = (
        "import json, sys, torch\n"
        "from transformers import LlamaConfig\n"
        "from tiered.testing.weights import write_random_weights\n"
        "s = json.loads(sys.argv[1])\n"
        "cfg = LlamaConfig(vocab_size=s['vocab'], hidden_size=s['hidden'], intermediate_size=s['inter'],\n"
        "    num_hidden_layers=s['layers'], num_attention_heads=s['heads'], num_key_value_heads=s['kv_heads'],\n"
        "    max_position_embeddings=4096, tie_word_embeddings=False)\n"
        "write_random_weights(sys.argv[2], cfg, dtype=torch.bfloat16, shard_bytes=1 << 30)\n"
    )
    subprocess.run([sys.executable, "-c", code, json.dumps(shape), str(folder)], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dir", default=None, help="directory on the NVMe drive for every file (default: temp dir)"
    )
    p.add_argument("--scale", type=float, default=20.0, help="the headline / the replica (default 20)")
    p.add_argument("--hidden", type=int, default=2048, help="the replica's hidden size (default 2048)")
    p.add_argument("--steps", type=int, default=3, help="steps (the first not timed; default 3)")
    p.add_argument("--seq", type=int, default=128, help="tokens per step (default 128)")
    p.add_argument("--bandwidth", default=None, help="tiered bench --json output for the plan's time model")
    p.add_argument("--weights", default=None, help="a folder this script wrote before (not deleted)")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--gpu-mem",
        default=None,
        help="GPU memory instead of the headline's / --scale (e.g. 1GiB; small runs)",
    )
    p.add_argument(
        "--cpu-mem",
        default=None,
        help="host memory instead of the headline's / --scale (e.g. 4GiB; small runs)",
    )
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be at least 2 (the first step is not timed)")
    shape = replica_shape(a.scale, a.hidden)
    print(f"replica 1/{a.scale:g}: {json.dumps(shape)}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="tiered-replica-", dir=a.dir))
    try:
        weights = Path(a.weights) if a.weights else work / "pretrained"
        if not a.weights:
            write_weights(weights, shape)
        (work / "swap").mkdir()
        spec = {
            "weights": str(weights),
            "nvme": str(work / "swap"),
            "gpu": parse_bytes(a.gpu_mem) if a.gpu_mem else HEADLINE["gpu"] / a.scale,
            "cpu": parse_bytes(a.cpu_mem) if a.cpu_mem else HEADLINE["cpu"] / a.scale,
            "nvme_mem": HEADLINE["nvme"] / a.scale,
            "steps": a.steps,
            "seq": a.seq,
            "bandwidth": a.bandwidth,
        }
        result = run_child(spec, "headline_replica")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["shape"], result["scale"], result["memories"] = (
        shape,
        a.scale,
        {k: spec[k] for k in ("gpu", "cpu", "nvme_mem")},
    )
    if a.json:  # before the report, so what was measured is kept whatever the report does
        Path(a.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(report(result))
    return 0


def tier_against_plan(plan: dict[str, Any], peaks: dict[str, int]) -> list[str]:
    """Each tier's measured peak over what the plan counts it at: the "gpu" tier at the plan's
    GPU peak (what the gathers and the live parameters reach, below the budget), a cpu tier
    with anything homed on disk at its budget (it caches up to it: [Note: a cpu tier caches up
    to its budget]), else at its need; a disk tier at its need. The pre-flight's minimum needs
    are not the peaks: a tier fills past its minimum wherever the budget lets it."""
    disk_homed = any(t not in ("gpu", "cpu") and n > 0 for t, n in plan["needs"].items())
    out = []
    for t, need in plan["needs"].items():
        if t == "gpu":
            ref, what = plan["peaks"]["device"], "GPU peak"
        elif t == "cpu" and disk_homed:
            ref, what = plan["budgets"][t], "budget"
        else:
            ref, what = need, "need"
        out.append(f"{t} {peaks.get(t, 0) / max(ref, 1):.3f} (of its {what})")
    return out


def report(r: dict[str, Any]) -> str:
    gib = 2**30
    if not r["fits"]:
        return f"nothing fits; closest {r['closest']}"
    plan, m = r["plan"], r["measured"]
    host_plan = plan["peaks"]["device"] + plan["peaks"]["host"]
    given = r["memories"]["gpu"] + r["memories"]["cpu"]
    lines = [
        f"chosen: {plan['knobs']}",
        f"plan peaks: GPU {plan['peaks']['device'] / gib:.2f} GiB, host {plan['peaks']['host'] / gib:.2f} GiB "
        f"(GPU + host {host_plan / gib:.2f} GiB; given {given / gib:.2f} GiB)",
        f"measured peak RSS {m['rss'] / gib:.2f} GiB = {m['rss'] / host_plan:.3f} x the plan's GPU + host"
        + (
            f" (loading {m['load_peak_rss'] / gib:.2f} GiB, the steps {m['steps_peak_rss'] / gib:.2f} GiB:"
            f" {m['steps_peak_rss'] / host_plan:.3f} x)"
            if m.get("load_peak_rss") and m.get("steps_peak_rss")
            else ""
        ),
        "tier peak / the plan's: " + ", ".join(tier_against_plan(plan, m["tier_peaks"])),
        f"NVMe per step: read {m['nvme_read'] / 1e9:.2f} GB, write {m['nvme_write'] / 1e9:.2f} GB; "
        f"plan {json.dumps({k: round(v / 1e9, 2) for k, v in plan['traffic'].items()})} GB; "
        f"formula {json.dumps({k: round(v / 1e9, 2) for k, v in m['formula'].items()})} GB",
        f"s/step measured {m['s_per_step']:.1f} (steps {', '.join(f'{s:.1f}' for s in m['steps_s'])}), "
        f"predicted {plan['s_per_step']:.1f}: {plan['s_per_step'] / m['s_per_step']:.2f}",
        f"losses {m['losses']}",
    ]
    if m.get("cpu_s_per_step"):  # the process's CPU seconds (user + system) per step, all threads
        lines.append(
            f"CPU seconds per step {', '.join(f'{c:.1f}' for c in m['cpu_s_per_step'])} on {m['cores']} cores"
        )
    if m.get("phases_s"):  # engine(...) / engine.backward / engine.step, per step
        lines.append(
            "forward / backward / step s: "
            + "; ".join(f"{p['forward']:.1f} / {p['backward']:.1f} / {p['step']:.1f}" for p in m["phases_s"])
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
