"""What benchmarks/big_model.py runs in its engine processes: the model and config it trains,
the measurements (peak RSS windows, raw O_DIRECT bandwidth, one layer's compute) and the two
phases (train from the streamed weights; resume from the checkpoint and export).

[Note: big model measurements interleaved]
This machine's two cores are shared: the same layer's forward+backward took 0.9 s or 6 s
minutes apart. A bound computed from a compute or bandwidth figure measured at another time
would say little, so the train phase samples both *between* its steps, in the same process:
after each step it waits for the optimizer's write-backs, times one decoder layer's
forward+backward and the embedding + head + loss (a fresh layer each time, freed after, so the
timing's memory is outside every step's RSS window), then one raw O_DIRECT write+read round
(tiered.bench's ceiling method). The step's bound uses the medians of those samples.
"""

from __future__ import annotations

import gc
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import torch

STATE_BYTES_PER_PARAM = 16
"""fp32 training state: parameter (= the Adam master) 4 + gradient 4 + exp_avg 4 + exp_avg_sq 4."""


# ---- the model and its config ------------------------------------------------------------------
def llama_config(params: float, layers: int, vocab: int, seq: int) -> Any:
    """A Llama config of about `params` parameters: `layers` decoder layers, the hidden size (a
    multiple of 128, of 64 below 1024) that comes closest, intermediate ~2.7x hidden (a multiple
    of 256), head size 128 (64 below 1024), untied embeddings."""
    from transformers import LlamaConfig

    def count(h: int) -> int:
        return layers * (4 * h * h + 3 * h * _inter(h) + 2 * h) + 2 * vocab * h + h

    best = min(
        (h for h in range(64, 16385, 64) if h < 1024 or h % 128 == 0), key=lambda h: abs(count(h) - params)
    )
    head_dim = 128 if best >= 1024 else 64
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=best,
        intermediate_size=_inter(best),
        num_hidden_layers=layers,
        num_attention_heads=best // head_dim,
        num_key_value_heads=best // head_dim,
        max_position_embeddings=max(seq, 128),
        tie_word_embeddings=False,
    )


def _inter(h: int) -> int:
    return max(256, int(round(2.7 * h / 256)) * 256)


def n_params(cfg: Any) -> int:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())


def engine_config(spec: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed JSON + tiered's keys: parameters, gradients and Adam state homed on NVMe; the gpu
    and cpu tiers' budgets the given fractions of the fp32 training state."""
    nvme, gpu_b = spec["nvme_dir"], spec["gpu_budget"]
    return {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": spec.get("accumulation", 1),
        "gradient_clipping": spec["clip"],
        # bf16 mixed precision: bf16 compute copies, fp32 master and Adam state (DeepSpeed's meaning)
        **({"bf16": {"enabled": True}} if spec.get("precision", "fp32") == "bf16" else {}),
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": spec["lr"], "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": spec["sub_group_size"],
            # gathered + prefetched + kept-for-reuse parameters may fill ~90% of the gpu tier
            "stage3_max_live_parameters": int(0.9 * gpu_b / 4),
            "stage3_prefetch_bucket_size": spec["prefetch_numel"],
            "stage3_param_persistence_threshold": 100_000,
            # max_in_cpu 0: the cpu tier is staging only (the headline's host memory holds no state)
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "max_in_cpu": 0},
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme,
                "pin_memory": True,
                "buffer_count": spec["buffer_count"],
            },
        },
        "tiered": {
            "tiers": {
                "gpu": {"budget": str(gpu_b)},
                "cpu": {"budget": str(spec["cpu_budget"])},
                # The swap holds 16 B/param, but the engine's capacity check counts the fp32 master
                # apart from the parameter it is (20 B/param) and compares with the free space left
                # after this run's checkpoint: an explicit budget (the script checked the disk for
                # its own peak before starting) keeps the resume from being refused.
                "nvme": {"budget": str(int(1.3 * STATE_BYTES_PER_PARAM * spec["params"]))},
            },
            "grad_tier": "nvme",
            "overlap_step_with_backward": spec["overlap"],
            # set only when compressed: the exact default stays the key's own (older trees lack it)
            **(
                {"optimizer_state_format": spec["state_format"]}
                if spec.get("state_format", "fp32") != "fp32"
                else {}
            ),
        },
    }


def batch_for(step: int, spec: dict[str, Any], micro: int = 0) -> dict[str, torch.Tensor]:
    """Global step `step`'s micro-batch `micro` (1-based step), seeded by both: a resumed run sees
    the same ones (micro-batch 0 keeps the seed runs without accumulation had)."""
    g = torch.Generator().manual_seed(1000 + step + 100_000 * micro)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


# ---- measurements ------------------------------------------------------------------------------
def status_bytes(key: str) -> int:
    """A /proc/self/status figure (VmRSS:, VmHWM:) in bytes; 0 where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> None:
    """Start a new VmHWM window (Linux: 5 into clear_refs resets the peak to the current RSS)."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not allowed: the peak then covers the process so far
        pass


def peak_rss() -> int:
    return status_bytes("VmHWM:")


def raw_bandwidth(directory: Path, size: int, rounds: int, warmup: int = 1) -> dict[str, Any]:
    """tiered.bench's O_DIRECT thread-pool ceiling (writes fsync'd, reads cold): median GB/s."""
    from tiered.bench.runner import BenchOptions, run_bandwidth

    res = run_bandwidth(
        BenchOptions(
            directory=directory,
            size_bytes=size,
            rounds=rounds,
            warmup_rounds=warmup,
            backends=(),
            fio=False,
            deepspeed=False,
        )
    )
    m = res.methods[0]
    if m.status != "ok" or not m.write_gbps or not m.read_gbps:
        raise RuntimeError(f"raw O_DIRECT bandwidth of {directory}: {m.status} {m.detail}")
    return {"write_gbps": m.write_gbps, "read_gbps": m.read_gbps, "size_bytes": size, "method": m.name}


def time_compute(spec: dict[str, Any], repeats: int = 1, warmup: int = 1) -> dict[str, Any]:
    """One decoder layer's forward+backward (its weights requiring grad, as in training) on the
    run's batch shape, and the embedding + final norm + head + loss; medians of `repeats`. The
    library's probe (`tiered plan --model`'s compute term, [Note: model compute probe]): the
    one-layer model is built there and freed on return."""
    from transformers import LlamaConfig

    from tiered.planning.compute_probe import probe_model_compute

    cfg = LlamaConfig.from_dict(spec["hf_config"])
    cfg._attn_implementation = spec["attn"]
    micro = spec.get("accumulation", 1)  # a step is that many forward+backward passes
    c = probe_model_compute(
        cfg,
        micro_batch=spec["batch"],
        seq_len=spec["seq"],
        dtype=torch.bfloat16 if spec.get("precision", "fp32") == "bf16" else torch.float32,
        seconds=float("inf"),
        max_passes=repeats,
        warmups=warmup,
    )
    return {
        "layer_fwd_bwd_s": c.layer_forward_s + c.layer_backward_s,
        "embed_head_fwd_bwd_s": c.rest_s,
        "compute_s": c.step_seconds(micro),
    }


def _link_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, dict[str, float]]:
    out = {}
    for link, v in b.get("links", {}).items():
        u = a.get("links", {}).get(link, {})
        nbytes = v.get("bytes", 0) - u.get("bytes", 0)
        if nbytes:
            out[link] = {"bytes": nbytes, "seconds": v.get("seconds", 0.0) - u.get("seconds", 0.0)}
    return out


def params_digest(engine: Any) -> str:
    """crc32 over every parameter's name and fp32 bytes, one group gathered at a time."""
    from tiered.zero.full_params import iter_full_groups

    crc = 0
    for _g, params in iter_full_groups(engine.zero):
        for name, t in params:
            crc = zlib.crc32(name.encode(), crc)
            crc = zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def train_step(engine: Any, step: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One step (its `accumulation` micro-batches), its wall time, loss (the micro-batches' mean),
    bytes per link, stall and peak RSS (its own window)."""
    micros = spec.get("accumulation", 1)
    batches = [batch_for(step, spec, m) for m in range(micros)]
    s0 = engine.stats()
    reset_peak_rss()
    t0 = time.perf_counter()
    losses = []
    for batch in batches:  # DeepSpeed's loop: step() at every micro-batch, the update at the last
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    dt = time.perf_counter() - t0
    rss = peak_rss()
    s1 = engine.stats()
    return {
        "step": step,
        "s": dt,
        "loss": sum(losses) / len(losses),
        "links": _link_delta(s0["tiers"], s1["tiers"]),
        "stall_s": s1["tiers"]["stall_s"] - s0["tiers"]["stall_s"],
        "timing": s1["timing"]["last_step"],
        "rss": rss,
    }


def _log(msg: str) -> None:
    import sys

    print(f"[big_model {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# ---- the phases, each in a fresh process ---------------------------------------------------------
def phase_weights(spec: dict[str, Any]) -> dict[str, Any]:
    """The "pretrained" folder: bf16 shards + index, seeded, a shard at a time."""
    from transformers import LlamaConfig

    from tiered.testing.weights import write_random_weights

    reset_peak_rss()
    t0 = time.perf_counter()
    write_random_weights(
        spec["weights_dir"],
        LlamaConfig.from_dict(spec["hf_config"]),
        dtype=torch.bfloat16,
        shard_bytes=spec["shard_bytes"],
        seed=0,
    )
    return {"s": time.perf_counter() - t0, "bytes": du(Path(spec["weights_dir"])), "rss": peak_rss()}


def phase_train(spec: dict[str, Any]) -> dict[str, Any]:
    """Fresh process: streaming load, the steps (compute and bandwidth sampled between them, see
    [Note: big model measurements interleaved]), checkpoint, one reference step, digest."""
    import tiered

    out: dict[str, Any] = {"rss": {}, "s": {}, "compute": [], "bandwidth": []}
    reset_peak_rss()
    t0 = time.perf_counter()
    engine = tiered.from_pretrained(
        spec["weights_dir"], engine_config(spec), attn_implementation=spec["attn"]
    )
    try:
        out["s"]["load"], out["rss"]["load"] = time.perf_counter() - t0, peak_rss()
        out["groups"] = len(engine.zero.groups)
        out["capacity"] = engine.stats()["capacity"]
        steps = []
        for step in range(1, spec["steps"] + 1):
            steps.append(train_step(engine, step, spec))
            _log(f"train step {step}: {steps[-1]['s']:.1f} s, loss {steps[-1]['loss']:.4f}")
            if step == 1 and spec["drop_weights"]:
                # The optimizer took its fp32 master in step 1: the files are not read again.
                for f in Path(spec["weights_dir"]).glob("*.safetensors"):
                    f.unlink()
            engine.optimizer.wait_writes()  # the samples run alone
            out["compute"].append(time_compute(spec, warmup=1 if step == 1 else 0))
            out["bandwidth"].append(raw_bandwidth(Path(spec["nvme_dir"]), spec["bw_size"], 1, warmup=0))
            _log(f"  compute {out['compute'][-1]['compute_s']:.2f} s; raw {out['bandwidth'][-1]}")
        out["steps"] = steps
        out["rss"]["train"] = max(s["rss"] for s in steps)
        if spec.get("train_only"):  # the steps measured; no checkpoint, no resume
            out["stats"] = engine.stats()
            return out
        reset_peak_rss()
        t0 = time.perf_counter()
        engine.save_checkpoint(spec["ckpt_dir"], tag="bench")
        out["s"]["checkpoint"], out["rss"]["checkpoint"] = time.perf_counter() - t0, peak_rss()
        out["checkpoint_bytes"] = du(Path(spec["ckpt_dir"]))
        out["disk_free_at_checkpoint"] = shutil.disk_usage(spec["ckpt_dir"]).free
        out["reference"] = train_step(engine, spec["steps"] + 1, spec)
        out["rss"]["reference_step"] = out["reference"]["rss"]
        t0 = time.perf_counter()
        out["digest"] = params_digest(engine)
        out["s"]["digest"] = time.perf_counter() - t0
        out["stats"] = engine.stats()
    finally:
        engine.close(restore_weights=False)  # the model does not fit on the host; deletes the swap
    return out


def phase_resume(spec: dict[str, Any]) -> dict[str, Any]:
    """Fresh process: the model from config.json on meta, load_checkpoint, the reference step
    again, digest, export (checked)."""
    import tiered
    from tiered.engine.pretrained import meta_causal_lm

    out: dict[str, Any] = {"rss": {}, "s": {}}
    reset_peak_rss()
    t0 = time.perf_counter()
    model = meta_causal_lm(spec["weights_dir"], attn_implementation=spec["attn"])
    engine = tiered.initialize(model, engine_config(spec))
    try:
        out["s"]["init"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.load_checkpoint(spec["ckpt_dir"], tag="bench")
        out["s"]["load_checkpoint"], out["rss"]["resume_load"] = time.perf_counter() - t0, peak_rss()
        shutil.rmtree(spec["ckpt_dir"])  # what it restored is checked by the step; disk for the export
        out["step"] = train_step(engine, spec["steps"] + 1, spec)
        out["rss"]["resume_step"] = out["step"]["rss"]
        out["digest"] = params_digest(engine)
        reset_peak_rss()
        t0 = time.perf_counter()
        engine.save_pretrained(spec["export_dir"])
        out["s"]["export"], out["rss"]["export"] = time.perf_counter() - t0, peak_rss()
        out["export"] = check_export(Path(spec["export_dir"]))
    finally:
        engine.close(restore_weights=False)
    return out


def check_export(folder: Path) -> dict[str, Any]:
    """Every parameter of config.json's model is there, bf16, of its shape, finite (read one
    tensor at a time)."""
    import json

    from safetensors import safe_open

    from tiered.engine.pretrained import meta_causal_lm

    want = {n: tuple(p.shape) for n, p in meta_causal_lm(folder).named_parameters()}
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        files = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    else:  # a single shard has no index
        files = ["model.safetensors"]
    seen: dict[str, tuple[int, ...]] = {}
    for fname in files:
        with safe_open(str(folder / fname), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if t.dtype != torch.bfloat16 or not bool(torch.isfinite(t).all()):
                    raise RuntimeError(f"export: {name} in {fname} is {t.dtype} or not finite")
                seen[name] = tuple(t.shape)
    if seen != want:
        missing, extra = sorted(set(want) - set(seen)), sorted(set(seen) - set(want))
        bad = sorted(n for n in set(want) & set(seen) if want[n] != seen[n])
        raise RuntimeError(f"export: missing {missing[:5]}, unexpected {extra[:5]}, wrong shapes {bad[:5]}")
    return {"tensors": len(seen), "bytes": du(folder), "shards": len(files)}


PHASES = {"weights": phase_weights, "train": phase_train, "resume": phase_resume}
