"""ZeRO-3 training step: plain PyTorch vs tiered (params + optimizer on NVMe) vs DeepSpeed ZeRO-3.

tiered runs the JSON twice: with ``tiered.residency: "off"`` every step moves the state through
NVMe as DeepSpeed's ZeRO-Infinity does (the like-for-like row), and with its default the cpu tier
keeps across steps what the host's memory has room for ([Note: residency]: on this model, all of
it), the row a user of the same JSON gets.

The model is the peer baseline's 35.7M-parameter Hugging Face Llama (hidden 512, 8 layers, 8 heads,
intermediate 2048, vocab 2048, untied), batch 4 x 128, fp32, AdamW lr 1e-3 wd 0.01, the same data
for every runner. Each runner does --steps steps (first --warmup not timed) and reports the median
step time, per-step bytes per link and stall time (tiered), overlap efficiency
= step time / max(compute time, busiest link time), where compute time is the plain PyTorch step
(the same math on the same cores) and a link's time is its measured busy seconds per step, and the
max relative loss difference vs plain PyTorch.

    python benchmarks/step.py [--steps 6] [--nvme-dir DIR] [--no-deepspeed] [--device cuda] [--json out.json]

DeepSpeed runs in a subprocess (DS_ACCELERATOR=cpu, gloo, one rank) with the same JSON; its aio op
JIT-builds (~2 min) the first time. Absent if not importable. With --device cuda (run by
benchmarks/gpu_check) the plain runner trains on the GPU and tiered's "gpu" tier is device memory;
DeepSpeed is then not run (this script only drives its CPU accelerator).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def make_data(steps: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 2048, (4, 128), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def ds_json(
    nvme_dir: str, pipeline_read: bool = False, precision: str = "fp32", accumulation: int = 1
) -> dict[str, Any]:
    """The JSON every runner trains with (fp32, one micro-batch per step unless asked)."""
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 0.0,
        **({"bf16": {"enabled": True}} if precision == "bf16" else {}),
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True},
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme_dir,
                "pin_memory": True,
                "pipeline_read": pipeline_read,
                "pipeline_write": pipeline_read,
            },
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": 10_000_000,
        },
        "aio": {
            "block_size": 1_048_576,
            "queue_depth": 8,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        },
    }


def _sync(device: str) -> None:
    """Timings on a GPU need the queued kernels finished."""
    if device == "cuda":
        torch.cuda.synchronize()


def _on(data: list[dict[str, torch.Tensor]], device: str) -> list[dict[str, torch.Tensor]]:
    return [{k: v.to(device) for k, v in b.items()} for b in data]


def run_plain(data: list[dict[str, torch.Tensor]], warmup: int, device: str = "cpu") -> dict[str, Any]:
    model = build_model().train().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    times, losses, phases = [], [], []
    for b in _on(data, device):
        _sync(device)
        t0 = time.perf_counter()
        loss = model(**b).loss
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        t3 = time.perf_counter()
        times.append(t3 - t0)
        phases.append((t1 - t0, t2 - t1, t3 - t2))
        losses.append(float(loss.detach()))
    return {
        "step_s": statistics.median(times[warmup:]),
        "times": times,
        "losses": losses,
        "params": sum(p.numel() for p in model.parameters()),
        "phases_per_step": {
            k: statistics.median(ph[j] for ph in phases[warmup:])
            for j, k in enumerate(("forward_s", "backward_s", "step_s"))
        },
    }


def _link_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, dict[str, float]]:
    out = {}
    for link, v in b.get("links", {}).items():
        u = a.get("links", {}).get(link, {})
        out[link] = {
            "bytes": v.get("bytes", 0) - u.get("bytes", 0),
            "seconds": v.get("seconds", 0.0) - u.get("seconds", 0.0),
        }
    return out


def run_tiered(
    data: list[dict[str, torch.Tensor]],
    warmup: int,
    nvme_dir: str,
    pipeline_read: bool = False,
    overlap: bool = False,
    device: str = "cpu",
    verify: bool = True,
    precision: str = "fp32",
    accumulation: int = 1,
    settle_writes: bool = False,
    residency: str = "off",
) -> dict[str, Any]:
    """`data` holds `accumulation` micro-batches per step: step() is called after each (DeepSpeed's
    loop) and the optimizer steps at the last; a step's figures span all of them. `settle_writes`
    (for byte counts, not times): each step's write-backs are waited for before its link counters
    are read, so they count in that step and not in the next one's window. `residency` "off" moves
    every step's state through NVMe as DeepSpeed does (the like-for-like row); "auto" is tiered's
    default, the cpu tier keeping what its budget has room for ([Note: residency])."""
    import tiered

    cfg = ds_json(nvme_dir, pipeline_read, precision, accumulation)
    # tiered's own keys, next to the DeepSpeed ones (DeepSpeed does not get them)
    cfg["tiered"] = {"residency": residency}
    if overlap:
        cfg["tiered"]["overlap_step_with_backward"] = True
    if not verify:  # to measure what the per-partition checksums cost
        cfg.setdefault("tiered", {})["verify_checksums"] = False
    model = build_model()
    times, losses, per_step = [], [], []
    with tiered.initialize(model, cfg) as engine:
        batches = _on(data, device)
        for first in range(0, len(batches) - accumulation + 1, accumulation):
            s0 = engine.stats()
            _sync(device)
            t0 = time.perf_counter()
            step_losses = []
            for b in batches[first : first + accumulation]:
                loss = engine(**b).loss
                engine.backward(loss)
                engine.step()
                step_losses.append(loss.detach())
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(float(sum(step_losses)) / accumulation)
            if settle_writes:
                engine.optimizer.wait_writes()
            s1 = engine.stats()
            opt = s1["optimizer"]["last_step"]
            per_step.append(
                {
                    "links": _link_delta(s0["tiers"], s1["tiers"]),
                    "stall_s": s1["tiers"].get("stall_s", 0.0) - s0["tiers"].get("stall_s", 0.0),
                    "optimizer": opt,
                    "timing": s1["timing"]["last_step"],
                }
            )
        final = engine.stats()
    timed = per_step[warmup:]
    links: dict[str, dict[str, float]] = {}
    for st in timed:
        for link, v in st["links"].items():
            d = links.setdefault(link, {"bytes": 0.0, "seconds": 0.0})
            d["bytes"] += v["bytes"] / len(timed)
            d["seconds"] += v["seconds"] / len(timed)
    return {
        "step_s": statistics.median(times[warmup:]),
        "times": times,
        "losses": losses,
        "links_per_step": links,
        "stall_s_per_step": statistics.median([s["stall_s"] for s in timed]),
        "optimizer_per_step": {
            k: statistics.median([s["optimizer"].get(k, 0.0) for s in timed])
            for k in ("read_wait_s", "compute_s", "write_wait_s")
        },
        "phases_per_step": {
            k: statistics.median([s["timing"].get(k, 0.0) for s in timed])
            for k in ("forward_s", "backward_s", "step_s")
        },
        "zero": final["zero"],
        "bytes_per_step_formula": final["bytes_per_step"]["formula"],  # [Note: bytes per step]
        "gpu_peak_bytes": final["tiers"]["tiers"]["gpu"]["peak_bytes"],
        "cpu_peak_bytes": final["tiers"]["tiers"]["cpu"]["peak_bytes"],
    }


_DS_CHILD = r"""
import json, os, sys, time, statistics
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29531")
os.environ.setdefault("RANK", "0"); os.environ.setdefault("WORLD_SIZE", "1"); os.environ.setdefault("LOCAL_RANK", "0")
sys.path.insert(0, sys.argv[1])
import torch, deepspeed
from step import build_model, make_data, ds_json
steps, warmup, nvme, pr = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
deepspeed.init_distributed(dist_backend="gloo")
model = build_model()
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_json(nvme, pr))
times, losses = [], []
for b in make_data(steps):
    t0 = time.perf_counter()
    loss = engine(**b).loss
    engine.backward(loss)
    engine.step()
    times.append(time.perf_counter() - t0)
    losses.append(float(loss.detach()))
print("RESULT " + json.dumps({"step_s": statistics.median(times[warmup:]), "times": times, "losses": losses}))
"""


def run_deepspeed(
    steps: int, warmup: int, nvme_dir: str, timeout_s: float, pipeline_read: bool
) -> dict[str, Any]:
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return {"absent": f"not importable: {type(e).__name__}: {e}"}
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    try:
        p = subprocess.run(
            [
                sys.executable,
                "-c",
                _DS_CHILD,
                str(HERE),
                str(steps),
                str(warmup),
                nvme_dir,
                "1" if pipeline_read else "0",
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"absent": f"timed out after {timeout_s:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return {"absent": "failed: " + " | ".join(tail)}


def checksum_ab(
    data: list[dict[str, torch.Tensor]],
    warmup: int,
    base: Path,
    rounds: int,
    pipeline_read: bool,
    device: str,
) -> dict[str, Any]:
    """What tiered.verify_checksums costs: `rounds` pairs of tiered runs, checksums on and off, in
    one process, the order flipped every round (on/off, off/on, ...) so drift and the load of other
    jobs fall on both alike; each run's median step time, the load average before it, and the
    median and spread of both sides and of the per-round ratio on/off."""
    runs: dict[str, list[float]] = {"on": [], "off": []}
    log: list[dict[str, Any]] = []
    for r in range(rounds):
        for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
            tdir = base / f"tiered_ab_{r}_{side}"
            tdir.mkdir(parents=True, exist_ok=True)
            load = os.getloadavg()[0]
            t = run_tiered(data, warmup, str(tdir), pipeline_read, device=device, verify=side == "on")
            shutil.rmtree(tdir, ignore_errors=True)
            runs[side].append(t["step_s"])
            log.append({"round": r, "checksums": side, "step_s": t["step_s"], "load1": load})
            print(f"round {r} checksums {side}: {t['step_s']:.3f} s/step (load {load:.2f})", flush=True)
    ratios = [a / b for a, b in zip(runs["on"], runs["off"], strict=True)]
    return {"runs": log, "on": runs["on"], "off": runs["off"], "ratio_on_off": ratios}


def checksum_toggle(data: list[dict[str, torch.Tensor]], nvme_dir: str, block: int = 2) -> dict[str, Any]:
    """What tiered.verify_checksums costs, finer than whole runs: one engine, verification
    switched on and off between steps in blocks of `block` steps (on, off, off, on, on, off, ...),
    only a block's last step timed (its reads were written in the same mode, so it verifies, or
    not, as a run would throughout). A probe reaching into the tier manager's transfers; it also
    sums the hashing threads' CPU time per step."""
    import threading

    import tiered
    import tiered.tiers.checksum as checksum
    import tiered.tiers.transfer as transfer

    lock, acc = threading.Lock(), {"cpu_s": 0.0, "bytes": 0}
    real = checksum.piece_digest

    def timed(b: torch.Tensor, offset: int, length: int) -> int:
        c0 = time.thread_time()
        out = real(b, offset, length)
        with lock:
            acc["cpu_s"] += time.thread_time() - c0
            acc["bytes"] += length
        return out

    checksum.piece_digest = transfer.piece_digest = timed  # type: ignore[assignment]
    out: dict[str, Any] = {
        "on": [],
        "off": [],
        "hash_cpu_s": [],
        "hashed_bytes": [],
        "proc_cpu_s": [],
        "steps": [],
    }
    try:
        with tiered.initialize(build_model(), ds_json(nvme_dir)) as engine:
            transfers = engine.tm._machine.transfers
            for i, b in enumerate(data):
                on = (i // block) % 4 in (0, 3)
                transfers.verify = on
                acc["cpu_s"], acc["bytes"] = 0.0, 0
                c0, t0 = time.process_time(), time.perf_counter()
                loss = engine(**b).loss
                engine.backward(loss)
                engine.step()
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                load = os.getloadavg()[0]
                out["steps"].append({"step": i, "checksums": on, "s": dt, "proc_cpu_s": dc, "load1": load})
                if i % block == block - 1 and i >= block:  # the first block warms up
                    out["on" if on else "off"].append(dt)
                    if on:
                        out["hash_cpu_s"].append(acc["cpu_s"])
                        out["hashed_bytes"].append(acc["bytes"])
                        out["proc_cpu_s"].append(dc)
                print(f"step {i} checksums {'on' if on else 'off'}: {dt:.3f} s (hash CPU "
                      f"{acc['cpu_s'] * 1e3:.0f} ms over {acc['bytes'] / 1e6:.0f} MB; load {load:.2f})", flush=True)  # fmt: skip
    finally:
        checksum.piece_digest = transfer.piece_digest = real  # type: ignore[assignment]
    return out


_TREE_CHILD = r"""
import inspect, json, os, statistics, sys, tempfile, shutil, time
import torch
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
import step
steps, warmup, runner = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
data = step.make_data(steps)
times, cpus, losses = [], [], []
def timed(run):
    for b in data:
        c0, t0 = time.process_time(), time.perf_counter()
        losses.append(run(b))
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
if runner == "plain":
    model = step.build_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    def one(b):
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    timed(one)
else:
    import tiered
    d = tempfile.mkdtemp(prefix="tiered_tree_", dir=sys.argv[5])
    cfg = step.ds_json(d)
    if "verify" in inspect.signature(step.run_tiered).parameters:  # the tree has checksums: off
        cfg["tiered"] = {"verify_checksums": False}
    with tiered.initialize(step.build_model(), cfg) as engine:
        def one(b):
            loss = engine(**b).loss
            engine.backward(loss)
            engine.step()
            return float(loss.detach())
        timed(one)
    shutil.rmtree(d, ignore_errors=True)
print("RESULT " + json.dumps({"step_s": statistics.median(times[warmup:]),
                              "cpu_s": statistics.median(cpus[warmup:]), "times": times, "losses": losses}))
"""


def compare_trees(trees: list[str], steps: int, warmup: int, base: Path, rounds: int) -> dict[str, Any]:
    """The tiered runner of each source tree (a checkout of another commit, its native kernels
    built in its own .cache), and plain PyTorch, each in a fresh process with that tree first on
    the path, in an order rotated every round; checksums off where the tree has them (a fair
    pair with trees from before they existed)."""
    names = ["plain", *trees]
    out: dict[str, Any] = {n: [] for n in names}
    out["runs"] = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            tree = trees[0] if n == "plain" else n
            env = dict(
                os.environ,
                PYTHONPATH=os.pathsep.join([tree, os.path.join(tree, "plugins")]),
                # a tree from before tiered_ext/_cache.py builds its kernel where torch's cache
                # says; this keeps each such tree's build its own (newer trees key the cache by
                # their sources and ignore it)
                TORCH_EXTENSIONS_DIR=os.path.join(tree, ".cache", "torch_extensions"),
            )
            load = os.getloadavg()[0]
            p = subprocess.run(
                [sys.executable, "-c", _TREE_CHILD, tree, str(steps), str(warmup),
                 "plain" if n == "plain" else "tiered", str(base)],
                capture_output=True, text=True, env=env, timeout=3600,
            )  # fmt: skip
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{n}: no result (rc {p.returncode}): {p.stderr.strip()[-2000:]}")
            res = json.loads(line[7:])
            out[n].append(res["step_s"])
            out.setdefault(f"{n} cpu", []).append(res["cpu_s"])
            out["runs"].append({"round": r, "tree": n, "step_s": res["step_s"], "cpu_s": res["cpu_s"],
                                "load1": load, "losses": res["losses"]})  # fmt: skip
            print(f"round {r} {n}: {res['step_s']:.3f} s/step, process CPU {res['cpu_s']:.3f} s/step "
                  f"(load {load:.2f})", flush=True)  # fmt: skip
    return out


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f}, n {len(xs)})"


def max_rel_loss_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps (the trace is recorded there)")
    ap.add_argument("--nvme-dir", default=None, help="directory for the NVMe files (default: a temp dir)")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument(
        "--pipeline-read",
        action="store_true",
        help="set offload_optimizer.pipeline_read/pipeline_write in the JSON (both runners)",
    )
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="also run tiered with tiered.overlap_step_with_backward (the optimizer step of each "
        "layer starts during backward)",
    )
    ap.add_argument("--deepspeed-timeout", type=float, default=900.0)
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where plain PyTorch trains and what tiered's gpu tier is (cuda: a GPU machine)",
    )
    ap.add_argument(
        "--no-verify-checksums", action="store_true", help="tiered.verify_checksums = false (tiered runs)"
    )
    ap.add_argument(
        "--checksum-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="instead of the comparison: ROUNDS pairs of tiered runs with checksums on and off, "
        "alternated, and the median and spread of each and of their ratio",
    )
    ap.add_argument(
        "--checksum-toggle",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead of the comparison: one tiered engine, STEPS steps, checksums switched on and "
        "off every 2 steps (the last step of each pair timed), and the hashing's CPU time",
    )
    ap.add_argument(
        "--compare-trees",
        nargs="+",
        default=None,
        metavar="DIR",
        help="instead of the comparison: the tiered runner of each source tree DIR (other commits' "
        "checkouts, kernels built there), and plain PyTorch, each in its own process, round-robin",
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds of --compare-trees")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    base = Path(args.nvme_dir or tempfile.mkdtemp(prefix="tiered_step_"))
    data = make_data(args.steps)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA GPU here")
    res: dict[str, Any] = {"pipeline_read": args.pipeline_read, "steps": args.steps, "warmup": args.warmup,
                           "threads": torch.get_num_threads(), "device": args.device}  # fmt: skip
    if args.compare_trees:
        trees = [str(Path(t).resolve()) for t in args.compare_trees]
        cmp_ = res["compare_trees"] = compare_trees(trees, args.steps, args.warmup, base, args.rounds)
        if args.nvme_dir is None:
            shutil.rmtree(base, ignore_errors=True)
        plain_s = statistics.median(cmp_["plain"])
        for n in ["plain", *trees]:
            xs = cmp_[n]
            per_round = [a / b for a, b in zip(xs, cmp_["plain"], strict=True)]
            print(f"{n}: s/step {_spread(xs)}; x plain {statistics.median(xs) / plain_s:.2f} "
                  f"(per round {_spread(per_round)}); process CPU s/step {_spread(cmp_[f'{n} cpu'])}")  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        return 0
    if args.checksum_toggle:
        tdir = base / "tiered_toggle"
        tdir.mkdir(parents=True, exist_ok=True)
        tg = res["checksum_toggle"] = checksum_toggle(make_data(args.checksum_toggle), str(tdir))
        if args.nvme_dir is None:
            shutil.rmtree(base, ignore_errors=True)
        for side in ("on", "off"):
            print(f"checksums {side}: s/step {_spread(tg[side])}")
        pairs = [a / b for a, b in zip(tg["on"], tg["off"], strict=False)]
        print(f"ratio on/off, consecutive blocks: {_spread(pairs)}")
        print(
            f"hashing CPU per verified step: {_spread(tg['hash_cpu_s'])} s over "
            f"{statistics.median(tg['hashed_bytes']) / 1e6:.0f} MB; process CPU per step "
            f"{statistics.median(tg['proc_cpu_s']):.3f} s"
        )
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        return 0
    res["plain"] = run_plain(data, args.warmup, args.device)
    if args.checksum_ab:
        ab = res["checksum_ab"] = checksum_ab(
            data, args.warmup, base, args.checksum_ab, args.pipeline_read, args.device
        )
        if args.nvme_dir is None:
            shutil.rmtree(base, ignore_errors=True)
        plain_s = res["plain"]["step_s"]
        print(f"\nplain PyTorch {plain_s:.3f} s/step")
        for side in ("on", "off"):
            xs = ab[side]
            print(f"checksums {side}: s/step {_spread(xs)}; x plain {statistics.median(xs) / plain_s:.2f}")
        print(f"ratio on/off per round: {_spread(ab['ratio_on_off'])}")
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        return 0
    tdir = base / "tiered"
    tdir.mkdir(parents=True, exist_ok=True)
    verify = not args.no_verify_checksums
    res["tiered"] = run_tiered(
        data, args.warmup, str(tdir), args.pipeline_read, device=args.device, verify=verify
    )
    if args.overlap:
        odir = base / "tiered_overlap"
        odir.mkdir(parents=True, exist_ok=True)
        res["tiered_overlap"] = run_tiered(data, args.warmup, str(odir), args.pipeline_read, overlap=True,
                                           device=args.device)  # fmt: skip
    rdir = base / "tiered_resident"
    rdir.mkdir(parents=True, exist_ok=True)
    res["tiered_resident"] = run_tiered(
        data, args.warmup, str(rdir), args.pipeline_read, device=args.device, residency="auto"
    )
    if args.device == "cuda":
        res["deepspeed"] = {"absent": "not run with --device cuda (this script drives its CPU accelerator)"}
    elif not args.no_deepspeed:
        ddir = base / "deepspeed"
        ddir.mkdir(parents=True, exist_ok=True)
        res["deepspeed"] = run_deepspeed(
            args.steps, args.warmup, str(ddir), args.deepspeed_timeout, args.pipeline_read
        )
    else:
        res["deepspeed"] = {"absent": "skipped (--no-deepspeed)"}
    if args.nvme_dir is None:
        shutil.rmtree(base, ignore_errors=True)

    plain = res["plain"]
    compute = plain["step_s"]
    variants = [("tiered", "tiered ZeRO-3, params+optimizer on NVMe (residency off)")]
    if "tiered_overlap" in res:
        variants.append(("tiered_overlap", "tiered, same + tiered.overlap_step_with_backward"))
    variants.append(("tiered_resident", "tiered, same JSON, the cpu tier keeping what fits (default)"))
    where = "GPU memory" if args.device == "cuda" else "memory"
    rows = [(f"plain PyTorch (AdamW, all in {where})", plain["step_s"], 1.0, "-", "-")]
    for key, label in variants:
        t = res[key]
        busiest = max(
            t["links_per_step"].items(), key=lambda kv: kv[1]["seconds"], default=("-", {"seconds": 0.0})
        )
        t["overlap_efficiency"] = t["step_s"] / max(compute, busiest[1]["seconds"])
        t["busiest_link"] = busiest[0]
        t["max_rel_loss_diff"] = max_rel_loss_diff(t["losses"], plain["losses"])
        rows.append(
            (
                label,
                t["step_s"],
                t["step_s"] / compute,
                f"{t['max_rel_loss_diff']:.1e}",
                f"{t['overlap_efficiency']:.2f}",
            )
        )
    ds = res["deepspeed"]
    if "absent" in ds:
        rows.append(
            (f"DeepSpeed ZeRO-3 NVMe: absent ({ds['absent'][:80]})", float("nan"), float("nan"), "-", "-")
        )
    else:
        ds["max_rel_loss_diff"] = max_rel_loss_diff(ds["losses"], plain["losses"])
        rows.append(
            (
                "DeepSpeed ZeRO-3 (CPU accel, gloo), params+optimizer on NVMe",
                ds["step_s"],
                ds["step_s"] / compute,
                f"{ds['max_rel_loss_diff']:.1e}",
                "-",
            )
        )
    print(
        f"\n{plain['params'] / 1e6:.1f}M-param Llama, batch 4x128, fp32, {args.steps} steps "
        f"(median of the last {args.steps - args.warmup}), {res['threads']} threads, "
        f"pipeline_read={args.pipeline_read}, device {args.device}\n"
    )
    print("| runner | s/step | x plain | max rel loss diff | overlap eff. |")
    print("|---|---|---|---|---|")
    for name, sec, r, d, e in rows:
        print(f"| {name} | {sec:.3f} | {r:.2f} | {d} | {e} |")
    pph = plain["phases_per_step"]
    print(
        f"\nplain PyTorch phases: forward {pph['forward_s']:.3f} s, backward {pph['backward_s']:.3f} s, "
        f"step {pph['step_s']:.3f} s"
    )
    for key, label in variants:
        t = res[key]
        print(f"\n{label}, per step:")
        print("| link | MB/step | busy s/step |")
        print("|---|---|---|")
        for link, v in sorted(t["links_per_step"].items()):
            print(f"| {link} | {v['bytes'] / 1e6:.1f} | {v['seconds']:.3f} |")
        formula = {k: round(v / 1e6, 1) for k, v in t["bytes_per_step_formula"].items()}
        print(f"[Note: bytes per step] formula, MB/step: {formula}")
        o, ph = t["optimizer_per_step"], t["phases_per_step"]
        print(
            f"\ncompute (plain step) {compute:.3f} s; forward {ph['forward_s']:.3f} s, backward "
            f"{ph['backward_s']:.3f} s, step {ph['step_s']:.3f} s (optimizer read wait {o['read_wait_s']:.3f}, "
            f"adam {o['compute_s']:.3f}, write wait {o['write_wait_s']:.3f}); tier stall "
            f"{t['stall_s_per_step']:.3f} s; busiest link {t['busiest_link']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
