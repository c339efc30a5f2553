"""issue 21, measured: the config the search chooses vs what the engine does with it (issue 36:
and a Mixtral whose weights are per-expert bf16 files, streamed by `tiered.from_pretrained`).

For each shape of the plan/engine test zoo (scaled small) at each host budget: a fresh process
runs `tiered.planning.search.search` (what `tiered plan` and ``"auto_config"`` run) over the
model on the meta device and writes the chosen config, as `tiered plan` does before a run; a
second fresh process builds the same model, `tiered.initialize`s it with that config, trains
--steps bf16 steps of --micro-batch x --seq-len tokens and reports its peak RSS (``ru_maxrss``),
the tiers' peaks, the NVMe bytes per step (link counters after the first step) and s/step next to
the plan's figures. On a machine without CUDA the gpu tier is host memory, so RSS is compared
with the plan's GPU + host peaks. The search is told the device kind of this machine (the
process baseline of [Note: one memory model]) and the activations of the batch it runs
([Note: activation estimate]; host memory on a CPU-only machine, [Note: compute memory on a
CPU-only machine]).

    python benchmarks/plan_vs_measured.py [--cpu-mem 1GiB 2GiB] [--gpu-mem 256MiB] [--steps 4]
        [--dir DIR] [--seq-len 64] [--micro-batch 1] [--bandwidth bench.json] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama-small-vocab": {},
    "llama-128k-ratio-vocab": {"vocab_size": 512 * 16},  # vocab / hidden as 128256 / 8192
    "llama-tied": {"tie_word_embeddings": True},
    "llama-gqa": {"num_key_value_heads": 2},
    "mixtral-moe": {"moe": True},
    "mixtral-moe-files": {"moe": True, "files": True},  # per-expert bf16 files streamed into pieces
    "llama-lora": {"lora": True},
}

_CHILD = r"""
import json, os, resource, sys, time
import torch, transformers
import tiered
from tiered.planning.candidate import Base
from tiered.planning.search import Memories, search
from tiered.planning.timing import DEFAULT_BANDWIDTH, read_bandwidth
from tiered.finetune.activations import estimate_activations
mode, shape, cpu_mem, gpu_mem, steps, nvme, bwfile, seq, batch = json.loads(sys.argv[1])
kw = dict(shape)
moe, lora, files = kw.pop("moe", False), kw.pop("lora", False), kw.pop("files", False)
base = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=8, vocab_size=4096, tie_word_embeddings=False)
if moe:
    hf = transformers.MixtralConfig(**{**base, "intermediate_size": 512, "num_local_experts": 4,
                                       "num_experts_per_tok": 2, **kw})
else:
    hf = transformers.LlamaConfig(**{**base, **kw})
torch.manual_seed(0)
with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(hf)
if lora:
    from tiered.finetune.lora import apply_lora, parse_lora_spec
    model = apply_lora(model, parse_lora_spec("r=8,targets=q_proj,v_proj"))
if mode == "plan":  # its own process, as `tiered plan` is before a run with its config
    raw = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
           "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"nvme_path": nvme}}}
    bw = dict(DEFAULT_BANDWIDTH) if not bwfile else read_bandwidth(bwfile)[0]
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    act = estimate_activations(hf, batch=batch, seq_len=seq, dtype=torch.bfloat16, checkpointing=False,
                               compute_on_cpu=kind == "cpu")
    res = search(model, Memories(gpu_mem, cpu_mem, 10 * 2**30, act.total_bytes),
                 nvme_path=nvme, bandwidth=bw, base=Base.read(raw, model), device_kind=kind)
    best = res.best
    if best is None:
        print("RESULT " + json.dumps({"fits": False, "closest": res.closest.knobs if res.closest else None}))
        sys.exit(0)
    plan = {"knobs": best.knobs, "peaks": best.peaks, "traffic": best.traffic, "s_per_step": best.seconds_per_step,
            "needs": {t: d["total"] for t, d in best.prediction.needs.items()}, "activations": act.total_bytes,
            "budgets": {t: s["budget"] for t, s in best.config["tiered"]["tiers"].items()}}
    print("RESULT " + json.dumps({"fits": True, "plan": plan, "config": best.config}))
    sys.exit(0)
folder = os.path.join(nvme, "pretrained")
if mode == "write":  # the folder as transformers writes it: one tensor per expert, sharded
    from tiered.testing.weights import write_random_weights
    write_random_weights(folder, hf, dtype=torch.bfloat16, shard_bytes=8 << 20)
    print("RESULT " + json.dumps({"fits": True}))
    sys.exit(0)
config = json.loads(open(os.path.join(nvme, "config.json")).read())
g = torch.Generator().manual_seed(1)
times, before = [], None
with (tiered.from_pretrained(folder, config) if files else tiered.initialize(model, config)) as engine:
    for i in range(steps):
        ids = torch.randint(0, hf.vocab_size, (batch, seq), generator=g)
        if i == 1:  # steps 2..: each window holds its own write-backs (waited for), not the last's
            engine.optimizer.wait_writes()
            before = engine.stats()["tiers"]["links"]
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.optimizer.wait_writes()
    st = engine.stats()
links = st["tiers"]["links"]
per = {k: (v["bytes"] - before.get(k, {}).get("bytes", 0)) / (steps - 1) for k, v in links.items()}
nvme_rw = sum(v for k, v in per.items() if k.startswith("nvme->")), sum(v for k, v in per.items() if k.endswith("->nvme"))
meas = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "tier_peaks": {t: d["peak_bytes"] for t, d in st["tiers"]["tiers"].items()},
        "nvme_read": nvme_rw[0], "nvme_write": nvme_rw[1], "s_per_step": sorted(times[1:])[len(times[1:]) // 2],
        "formula": st["bytes_per_step"]["formula"]}
print("RESULT " + json.dumps({"fits": True, "measured": meas}))
"""


def parse_size(s: str) -> int:
    from tiered.units import parse_bytes

    return parse_bytes(s, what="size")


def _child(arg: list[Any]) -> tuple[dict[str, Any] | None, str]:
    """One fresh process: ("plan", ...) runs the search, ("run", ...) trains the config.json the
    plan wrote; its RESULT line, or None and the end of its stderr."""
    p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(arg)], capture_output=True, text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return None, f"rc {p.returncode}: {p.stderr.strip()[-300:]}"
    return json.loads(line[7:]), ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-mem", nargs="+", default=["1GiB", "2GiB"])
    ap.add_argument("--gpu-mem", default="256MiB")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--dir", default=None)
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence the run trains on")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per step")
    ap.add_argument("--bandwidth", default=None, help="tiered bench --json output")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.dir is not None:
        os.makedirs(a.dir, exist_ok=True)
    rows = []
    print(f"load average at start: {os.getloadavg()}", flush=True)
    print("| shape | cpu given | chosen (opt/param/grad, sgs, bc) | plan GPU+host | measured RSS | RSS/plan | "
          "RSS <= given (cpu+gpu) | plan NVMe r/w per step | measured NVMe r/w | plan s/step | measured s/step | load |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in a.shapes:
        for cpu in a.cpu_mem:
            with tempfile.TemporaryDirectory(dir=a.dir) as d:
                args = [SHAPES[name], parse_size(cpu), parse_size(a.gpu_mem), a.steps, d, a.bandwidth]
                if SHAPES[name].get("files"):  # written before, in its own process: not in the run's RSS
                    _child(["write", *args, a.seq_len, a.micro_batch])
                r, err = _child(["plan", *args, a.seq_len, a.micro_batch])
                if r is not None and r["fits"]:
                    with open(os.path.join(d, "config.json"), "w") as f:
                        json.dump(r.pop("config"), f)
                    ran, err = _child(["run", *args, a.seq_len, a.micro_batch])
                    r = None if ran is None else {**r, "measured": ran["measured"]}
            load = os.getloadavg()[0]
            if r is None:
                print(f"| {name} | {cpu} | FAILED: {err!r} |", flush=True)
                continue
            r.update(shape=name, cpu_mem=cpu, load1=load)
            rows.append(r)
            if not r["fits"]:
                print(f"| {name} | {cpu} | nothing fits (closest {r['closest']}) |", flush=True)
                continue
            pl, m = r["plan"], r["measured"]
            k = pl["knobs"]
            want = pl["peaks"]["device"] + pl["peaks"]["host"]
            gib = 2**30
            print(f"| {name} | {cpu} | {k['offload_optimizer']}/{k['offload_param']}/{k['grad_tier']}, "
                  f"{k['sub_group_size']:.0e}, {k['buffer_count']} | {want / gib:.3f} GiB | {m['rss'] / gib:.3f} GiB | "
                  f"{m['rss'] / want:.2f} | {m['rss'] <= parse_size(cpu) + parse_size(a.gpu_mem)} | {pl['traffic']['disk->host'] / 1e6:.1f} / {pl['traffic']['host->disk'] / 1e6:.1f} MB | "
                  f"{m['nvme_read'] / 1e6:.1f} / {m['nvme_write'] / 1e6:.1f} MB | {pl['s_per_step']:.3f} | "
                  f"{m['s_per_step']:.3f} | {load:.2f} |", flush=True)  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
