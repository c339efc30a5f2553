"""The scaled replica of the headline: fine-tune a pretrained Llama whose fp32 training state is
larger than this machine's RAM, from streamed safetensors, in the proportions of 40B on an 80 GB
GPU with 64 GB of host RAM: the gpu tier ~12% of the training state, the cpu tier ~10%, the rest
(parameters, gradients, Adam state) on NVMe.

    python benchmarks/big_model.py --dir DIR --json big.json       # 2.07B parameters, ~58 GB of disk
    python benchmarks/big_model.py --dir DIR --params 200e6 --layers 8 --vocab 8192   # small, same path
    python benchmarks/big_model.py --dir DIR --precision bf16 --accumulation 2   # bf16 mixed, 2 micro-batches

Phases, each in a fresh process (timed, peak RSS = VmHWM per phase):
1. the "pretrained" weights: sharded bf16 safetensors + index, seeded, written a shard at a time
   (tiered.testing.weights: the model never exists on the host);
2. `tiered.from_pretrained` (streaming load), --steps AdamW steps with one layer's compute and
   the raw O_DIRECT bandwidth sampled between them (see [Note: big model measurements
   interleaved] in big_model_engine.py), a checkpoint, one more step (the reference), a digest of
   every parameter; close deletes the engine's swap;
3. the model from config.json on the meta device, `load_checkpoint` (then
   the checkpoint is deleted), the reference step again (loss and parameters after it must equal
   the reference's bit for bit), `save_pretrained` (export, checked: every tensor, bf16, finite).

Reported (text; --json also a file): s/step (median of the steps after the first, the reference
one included), bytes per
link per step and stall seconds (engine.stats()), peak RSS per phase against the budgets (target:
gpu + cpu budget + 2 GiB; without a GPU the gpu tier is host memory), and the step's ratio to
its bound max(compute, I/O) (target <= 1.25): compute = layers x one layer's forward+backward +
embedding/head/loss, I/O = NVMe bytes read / raw read GB/s + bytes written / raw write GB/s (one
drive does both). Exit status 1 if the resume or the export check fails (targets are reported).
Every file lives in one work directory under --dir, removed at the end, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import big_model_engine as eng

GIB = 1 << 30
HEADROOM = 2 * GIB
"""The RSS target's slack above the tier budgets (the issue's target)."""
CHECKPOINT_BYTES_PER_PARAM = 12
"""A checkpoint holds the fp32 master (the parameter), exp_avg and exp_avg_sq."""
DISK_MARGIN = 3 * GIB
"""Free space kept beyond the estimated peak (bandwidth samples, logs, others' files)."""


def disk_plan(n: int, bw_size: int, drop_weights: bool, train_only: bool = False) -> dict[str, int]:
    """Estimated bytes on disk: the peak is the swap with the checkpoint (the pretrained files
    are deleted after the first step unless kept, and the checkpoint before the export; none with
    --train-only)."""
    swap, weights = eng.STATE_BYTES_PER_PARAM * n, 2 * n
    ckpt = 0 if train_only else CHECKPOINT_BYTES_PER_PARAM * n
    peak = swap + ckpt + (0 if drop_weights else weights) + max(bw_size, 0)
    return {"weights": weights, "swap": swap, "checkpoint": ckpt, "export": 2 * n, "peak": peak + DISK_MARGIN}


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def wait_for_memory(need: int, wait_s: float, what: str) -> None:
    """On a shared machine another job may hold the memory the engine process is budgeted: wait
    up to `wait_s` for `need` bytes to be available, then refuse clearly (rather than be killed)."""
    deadline = time.monotonic() + wait_s
    while (avail := mem_available()) is not None and avail < need:
        if time.monotonic() > deadline:
            raise SystemExit(
                f"big_model: {what} needs about {need / GIB:.1f} GiB of memory (tier budgets + 2 GiB), "
                f"{avail / GIB:.1f} GiB available after waiting {wait_s:.0f} s; free memory or lower --params"
            )
        eng._log(f"{what}: {avail / GIB:.1f} GiB available, waiting for {need / GIB:.1f} GiB")
        time.sleep(10)


class _Child:
    """The process of a phase (fresh: its own peak RSS); terminated, by its pid, if the
    orchestrator is interrupted."""

    current: subprocess.Popen[bytes] | None = None

    @classmethod
    def run(cls, phase: str, spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
        if phase != "weights":  # an engine process
            need = spec["gpu_budget"] + spec["cpu_budget"] + HEADROOM
            wait_for_memory(need, spec["mem_wait_s"], f"phase {phase}")
        spec_path, out_path = workdir / f"{phase}.spec.json", workdir / f"{phase}.out.json"
        spec_path.write_text(json.dumps(spec))
        script = str(Path(__file__).resolve())
        cls.current = subprocess.Popen(
            [sys.executable, script, "--phase", phase, "--spec", str(spec_path), "--out", str(out_path)]
        )
        rc = cls.current.wait()  # (interrupted: `stop` terminates it)
        cls.current = None
        if rc != 0:
            raise RuntimeError(f"phase {phase} failed (exit status {rc}); its output is above")
        return dict(json.loads(out_path.read_text()))

    @classmethod
    def stop(cls) -> None:
        p = cls.current
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _sigterm(_sig: int, _frame: Any) -> None:
    raise KeyboardInterrupt("SIGTERM")  # (timeout sends it): the finally blocks remove the files


def summarize(spec: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """The report: the step against its bound, traffic, stalls, RSS against the budgets."""
    tr, rs = res["train"], res.get("resume")
    # the first step also records the trace and takes the fp32 master; the reference step (after
    # the checkpoint) is an ordinary one
    ran = [*tr["steps"], *([tr["reference"]] if "reference" in tr else [])]
    timed = ran[1:]
    step_s = statistics.median(s["s"] for s in timed)
    links: dict[str, dict[str, float]] = {}
    for st in timed:
        for link, v in st["links"].items():
            d = links.setdefault(link, {"bytes": 0.0, "seconds": 0.0})
            d["bytes"] += v["bytes"] / len(timed)
            d["seconds"] += v["seconds"] / len(timed)
    nvme_read = sum(v["bytes"] for k, v in links.items() if k.startswith("nvme->"))
    nvme_write = sum(v["bytes"] for k, v in links.items() if k.endswith("->nvme"))
    read_gbps = statistics.median(b["read_gbps"] for b in tr["bandwidth"])
    write_gbps = statistics.median(b["write_gbps"] for b in tr["bandwidth"])
    io_s = nvme_read / (read_gbps * 1e9) + nvme_write / (write_gbps * 1e9)
    compute_s = statistics.median(c["compute_s"] for c in tr["compute"])
    layer_s = statistics.median(c["layer_fwd_bwd_s"] for c in tr["compute"])
    bound = max(compute_s, io_s)
    budget = spec["gpu_budget"] + spec["cpu_budget"]
    rss = {
        **({"weights": res["weights"]["rss"]} if res["weights"]["rss"] else {}),
        **tr["rss"],
        **(rs["rss"] if rs else {}),
    }
    phases = {f"train:{k}": v for k, v in tr["s"].items()} | {
        f"resume:{k}": v for k, v in (rs["s"] if rs else {}).items()
    }
    per_step = tr["stats"].get("bytes_per_step", {})
    return {
        "params": spec["params"],
        "layers": spec["layers"],
        "hidden": spec["hf_config"]["hidden_size"],
        "vocab": spec["vocab"],
        "tokens_per_step": spec["batch"] * spec["seq"] * spec.get("accumulation", 1),
        "threads": spec["threads"],
        "training_state_bytes": spec["state_bytes"],
        "budgets": {"gpu": spec["gpu_budget"], "cpu": spec["cpu_budget"], "rss_target": budget + HEADROOM},
        "step_s": step_s,
        "state_format": spec.get("state_format", "fp32"),
        "precision": spec.get("precision", "fp32"),
        "accumulation": spec.get("accumulation", 1),
        "steps_s": [s["s"] for s in ran],
        "step_phases_s": [s["timing"] for s in ran],
        "losses": [s["loss"] for s in ran],
        "links_per_step": links,
        "formula_per_step": per_step.get("formula"),
        "nvme_read_bytes_per_step": nvme_read,
        "nvme_write_bytes_per_step": nvme_write,
        "stall_s_per_step": statistics.median(s["stall_s"] for s in timed),
        "raw_read_gbps": read_gbps,
        "raw_write_gbps": write_gbps,
        "layer_fwd_bwd_s": layer_s,
        "compute_s": compute_s,
        "io_s": io_s,
        "bound_s": bound,
        "bound_is": "compute" if compute_s >= io_s else "io",
        "ratio_to_bound": step_s / bound,
        "ratio_target": 1.25,
        "peak_rss": rss,
        "peak_rss_max": max(rss.values()),
        "rss_within_target": max(rss.values()) <= budget + HEADROOM,
        "resume_loss_equal": rs["step"]["loss"] == tr["reference"]["loss"] if rs else None,
        "resume_params_equal": rs["digest"] == tr["digest"] if rs else None,
        "export": rs["export"] if rs else None,
        "phase_s": {"weights:write": res["weights"]["s"], **phases},
        "checkpoint_bytes": tr.get("checkpoint_bytes"),
        "groups": tr["groups"],
        "disk": res["disk"],
    }


def report_text(r: dict[str, Any]) -> str:
    gb = 1e9
    links = ", ".join(
        f"{k} {v['bytes'] / gb:.2f} GB ({v['seconds']:.1f} s busy)"
        for k, v in sorted(r["links_per_step"].items())
    )
    rss = ", ".join(f"{k} {v / GIB:.2f}" for k, v in r["peak_rss"].items())
    formula = ", ".join(f"{k} {v / gb:.2f} GB" for k, v in sorted((r["formula_per_step"] or {}).items()))
    verdict = "within" if r["rss_within_target"] else "ABOVE"
    return (
        "\n".join(
            [
                f"model: {r['params'] / 1e9:.3f}B params ({r['layers']} layers, hidden {r['hidden']}, vocab "
                f"{r['vocab']}); fp32 training state {r['training_state_bytes'] / GIB:.1f} GiB; {r['groups']} groups; "
                f"{r['tokens_per_step']} tokens/step; {r['threads']} torch threads",
                f"budgets: gpu {r['budgets']['gpu'] / GIB:.2f} GiB, cpu {r['budgets']['cpu'] / GIB:.2f} GiB; "
                f"RSS target {r['budgets']['rss_target'] / GIB:.2f} GiB",
                f"step: {r['step_s']:.2f} s (steps {', '.join(f'{s:.1f}' for s in r['steps_s'])}); bound "
                f"{r['bound_s']:.2f} s ({r['bound_is']}; compute {r['compute_s']:.2f} s = layer "
                f"{r['layer_fwd_bwd_s']:.3f} s x {r['layers']} + head, I/O {r['io_s']:.2f} s); ratio "
                f"{r['ratio_to_bound']:.2f} (target <= {r['ratio_target']})",
                f"raw O_DIRECT: read {r['raw_read_gbps']:.2f} GB/s, write {r['raw_write_gbps']:.2f} GB/s; "
                f"stall {r['stall_s_per_step']:.2f} s/step",
                f"per step: {links}",
                f"formula per step ([Note: bytes per step]): {formula}; state format {r['state_format']}, "
                f"precision {r['precision']}, accumulation {r['accumulation']}",
                f"peak RSS (GiB): {rss}; max {r['peak_rss_max'] / GIB:.2f} GiB, {verdict} the target",
                (
                    f"resume: loss equal {r['resume_loss_equal']}, parameters equal {r['resume_params_equal']}; "
                    f"export {r['export']['tensors']} tensors, {r['export']['bytes'] / gb:.2f} GB; checkpoint "
                    f"{r['checkpoint_bytes'] / gb:.2f} GB"
                    if r["export"]
                    else "resume: not run (--train-only)"
                ),
                "phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in r["phase_s"].items()),
                f"losses: {', '.join(f'{x:.4f}' for x in r['losses'])}",
            ]
        )
        + "\n"
    )


def make_spec(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    if args.weights:  # a folder written before (this script's, or any Llama in bf16/fp32 shards)
        from transformers import LlamaConfig

        cfg = LlamaConfig.from_pretrained(args.weights, local_files_only=True)
    else:
        cfg = eng.llama_config(args.params, args.layers, args.vocab, args.seq)
    n = eng.n_params(cfg)
    state = eng.STATE_BYTES_PER_PARAM * n
    per_layer = (n - 2 * cfg.vocab_size * cfg.hidden_size) / cfg.num_hidden_layers
    return {
        "params": n,
        "layers": cfg.num_hidden_layers,
        "vocab": cfg.vocab_size,
        "seq": args.seq,
        "batch": args.batch,
        "steps": args.steps,
        "lr": args.lr,
        "clip": args.clip,
        "overlap": not args.no_overlap,
        "state_format": args.state_format,
        "precision": args.precision,
        "accumulation": args.accumulation,
        "train_only": args.train_only,
        "attn": args.attn,
        "hf_config": cfg.to_dict(),
        "state_bytes": state,
        "gpu_budget": int(args.gpu_frac * state),
        "cpu_budget": int(args.cpu_frac * state),
        # the optimizer pipeline stages ~buffer_count sub-groups: 1% of the model keeps it within the cpu tier
        "sub_group_size": args.sub_group_size or max(1_000_000, round(n / 100, -6)),
        "prefetch_numel": int(args.prefetch_layers * per_layer),
        "buffer_count": args.buffer_count,
        "bw_size": args.bw_size,
        "weights_dir": str(Path(args.weights).resolve()) if args.weights else str(workdir / "pretrained"),
        "nvme_dir": str(workdir / "swap"),
        "ckpt_dir": str(workdir / "checkpoint"),
        "export_dir": str(workdir / "export"),
        "drop_weights": not args.keep_weights and not args.weights,  # never a folder given
        "shard_bytes": args.shard_bytes,
        "threads": args.threads or torch.get_num_threads(),
        "mem_wait_s": args.mem_wait,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every phase, then the report; the work directory is removed whatever happens."""
    base = Path(args.dir if args.dir is not None else tempfile.gettempdir())
    if not base.is_dir():
        raise SystemExit(f"big_model: --dir {base} is not a directory")
    spec = make_spec(args, base / "tiered-big-XXXX")  # the sizes, before anything is written
    n, state = spec["params"], spec["state_bytes"]
    disk = disk_plan(
        n, args.bw_size, spec["drop_weights"] or bool(args.weights), args.train_only
    )  # a given folder is there already
    disk["free_at_start"] = free = shutil.disk_usage(base).free
    if free < disk["peak"]:
        raise SystemExit(
            f"big_model: {free / 1e9:.1f} GB free under {base}; the run needs about {disk['peak'] / 1e9:.1f} GB at "
            f"its peak (swap {disk['swap'] / 1e9:.1f} GB + checkpoint {disk['checkpoint'] / 1e9:.1f} GB + "
            f"margin): free space or pass a smaller --params"
        )
    signal.signal(signal.SIGTERM, _sigterm)
    workdir = Path(tempfile.mkdtemp(prefix="tiered-big-", dir=base))
    res: dict[str, Any] = {"disk": disk}
    try:
        spec = make_spec(args, workdir)
        eng._log(
            f"{n / 1e9:.3f}B params (hidden {spec['hf_config']['hidden_size']}, {spec['layers']} layers), fp32 state "
            f"{state / GIB:.1f} GiB; gpu tier {spec['gpu_budget'] / GIB:.2f} GiB, cpu tier "
            f"{spec['cpu_budget'] / GIB:.2f} GiB; disk peak ~{disk['peak'] / 1e9:.1f} of {free / 1e9:.1f} GB free"
        )
        if args.weights:
            res["weights"] = {"s": 0.0, "bytes": eng.du(Path(args.weights)), "rss": 0, "given": args.weights}
        else:
            res["weights"] = _Child.run("weights", spec, workdir)
            eng._log(f"weights: {res['weights']['bytes'] / 1e9:.2f} GB in {res['weights']['s']:.1f} s")
        res["train"] = _Child.run("train", spec, workdir)
        if not args.train_only:
            res["resume"] = _Child.run("resume", spec, workdir)
    except BaseException:
        if args.json:  # what the phases that finished measured, for the write-up
            Path(args.json + ".partial").write_text(json.dumps(res, indent=1, default=float) + "\n")
        raise
    finally:
        _Child.stop()
        if args.keep:
            eng._log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    out = summarize(spec, res)
    out["raw"] = {
        "weights": res["weights"],
        "train_steps": res["train"]["steps"],
        "compute_samples": res["train"]["compute"],
        "bandwidth_samples": res["train"]["bandwidth"],
        "reference_step": res["train"].get("reference"),
        "resume_step": res["resume"]["step"] if "resume" in res else None,
        "capacity": res["train"]["capacity"],
        "engine_stats": res["train"]["stats"],
    }
    out["load_average"] = os.getloadavg()
    return out


def argument_parser() -> argparse.ArgumentParser:
    """The replica's options (also read by benchmarks/big_model_predict.py: the same defaults)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dir", default=None, help="directory on the NVMe drive for every file (default: temp dir)"
    )
    p.add_argument(
        "--params", type=float, default=2.07e9, help="target parameters (default 2.07e9: 30.8 GiB state)"
    )
    p.add_argument("--layers", type=int, default=25, help="decoder layers (default 25)")
    p.add_argument("--vocab", type=int, default=16384, help="vocabulary (default 16384)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument(
        "--accumulation",
        type=int,
        default=1,
        help="gradient_accumulation_steps: micro-batches per step (default 1)",
    )
    p.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16"],
        help="compute precision (bf16: DeepSpeed's bf16.enabled, fp32 master and Adam state)",
    )
    p.add_argument(
        "--steps", type=int, default=2, help="steps before the checkpoint, then one more (default 2; >= 2)"
    )
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument(
        "--clip", type=float, default=0.0, help="gradient_clipping (default 0: the step overlaps backward)"
    )
    p.add_argument("--no-overlap", action="store_true", help="without tiered.overlap_step_with_backward")
    p.add_argument(
        "--state-format",
        default="fp32",
        choices=["fp32", "bf16", "int8"],
        help="tiered.optimizer_state_format (default fp32: exact Adam state)",
    )
    p.add_argument(
        "--train-only", action="store_true", help="the steps only: no checkpoint, resume or export phase"
    )
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--gpu-frac", type=float, default=0.12, help="gpu tier budget / fp32 training state")
    p.add_argument("--cpu-frac", type=float, default=0.10, help="cpu tier budget / fp32 training state")
    p.add_argument(
        "--sub-group-size",
        type=int,
        default=None,
        help="elements (default: 1%% of the parameters, 2e7 at 2B)",
    )
    p.add_argument("--buffer-count", type=int, default=4, help="offload_optimizer.buffer_count (default 4)")
    p.add_argument("--prefetch-layers", type=float, default=2.0, help="prefetch bucket, in decoder layers")
    p.add_argument("--shard-bytes", type=int, default=GIB, help="pretrained shard size (default 1 GiB)")
    p.add_argument("--bw-size", type=int, default=GIB, help="bytes per raw O_DIRECT sample (default 1 GiB)")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads in every phase (default: torch's, the cores)"
    )
    p.add_argument(
        "--mem-wait", type=float, default=600, help="seconds to wait for the memory an engine phase needs"
    )
    p.add_argument(
        "--weights",
        default=None,
        metavar="FOLDER",
        help="train from this model folder (not written, not deleted)",
    )
    p.add_argument("--keep-weights", action="store_true", help="keep the pretrained files to the end")
    p.add_argument("--keep", action="store_true", help="leave the work directory (debugging)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    p.add_argument("--phase", choices=sorted(eng.PHASES), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = argument_parser()
    args = p.parse_args(argv)
    if args.phase:  # an engine process started by run()
        spec = json.loads(Path(args.spec).read_text())
        torch.set_num_threads(spec["threads"])
        result = eng.PHASES[args.phase](spec)
        Path(args.out).write_text(json.dumps(result, default=float))
        return 0
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is not timed; 3 steps in all)")
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args)
    report["command"] = "python benchmarks/big_model.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    sys.stdout.write(report_text(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=float) + "\n")
    if args.train_only:
        return 0
    return 0 if report["resume_loss_equal"] and report["resume_params_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
