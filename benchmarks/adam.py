#!/usr/bin/env python
"""CPU Adam side by side: torch AdamW (fused, foreach), DeepSpeedCPUAdam, tiered's fused kernel,
and the offload step (bf16 grad in, bf16 param out) as a user writes it vs fused; with a 1 GiB
memory copy measured in the same run as the bandwidth yardstick.

    OMP_NUM_THREADS=2 python benchmarks/adam.py [--threads 2 1] [--json out.json] [--write-results]

~64M parameters in 32 tensors (8 x [4M, 2M, 1M, 1M], M = 2^20). Median of --repeats timed steps
after --warmup steps. Bytes per parameter count the traffic each method must move at least
(fp32 Adam: read p, g, m, v + write p, m, v = 28 B), so effective GB/s compares with the copy.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed must not look for a GPU here

import torch

import tiered_ext
from tiered.optim import CPUAdam

M = 1 << 20
SHAPES = [4 * M, 2 * M, 1 * M, 1 * M] * 8
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _fp32_params(shapes: list[int]) -> list[torch.nn.Parameter]:
    params = []
    for n in shapes:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n) * 1e-2
        params.append(p)
    return params


def _deepspeed_cls():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        DeepSpeedCPUAdam(
            [torch.nn.Parameter(torch.zeros(1))]
        )  # builds (JIT, ~45 s the first time) and loads its op
    except Exception as exc:  # noqa: BLE001 - not installed, or its op cannot build here: reported
        return None, f"absent ({type(exc).__name__}: {str(exc)[:80]})"
    return DeepSpeedCPUAdam, ""


def _methods(shapes: list[int], deepspeed_cls) -> dict[str, Callable[[], None]]:
    """One step function per method. The fp32 optimizers share one set of parameters and gradients
    (each keeps its own moments), which keeps the run's memory near 5 GB."""
    params = _fp32_params(shapes)
    hyper = dict(lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
    out: dict[str, Callable[[], None]] = {}
    out[TORCH_FUSED] = torch.optim.AdamW(params, **hyper, fused=True).step
    out[TORCH_FOREACH] = torch.optim.AdamW(params, **hyper, foreach=True).step
    if deepspeed_cls is not None:
        out[DEEPSPEED] = deepspeed_cls(params, **hyper, adamw_mode=True, fp32_optimizer_states=True).step
    out[OURS] = CPUAdam(params, **hyper).step

    # The offload step as a user writes it without a fused kernel: upcast the bf16 gradients into
    # the fp32 masters' .grad, run torch's fastest CPU AdamW (fused), copy the masters out to bf16.
    masters = [torch.nn.Parameter(torch.randn(n)) for n in shapes]
    g16 = [torch.randn(n).mul_(1e-2).to(torch.bfloat16) for n in shapes]
    out16 = [torch.empty(n, dtype=torch.bfloat16) for n in shapes]
    for p in masters:
        p.grad = torch.empty_like(p)
    user_opt = torch.optim.AdamW(masters, **hyper, fused=True)

    def user_step() -> None:
        for p, g in zip(masters, g16, strict=True):
            p.grad.copy_(g)
        user_opt.step()
        with torch.no_grad():
            for o, p in zip(out16, masters, strict=True):
                o.copy_(p)

    out[OFFLOAD_USER] = user_step
    ms = [torch.zeros(n) for n in shapes]
    vs = [torch.zeros(n) for n in shapes]
    count = {"step": 0}
    b1, b2 = HYPER["betas"]

    master_data = [p.data for p in masters]

    def fused_step() -> None:
        # The multi-tensor entry point (CPU lists: one parallel region for all 32 partitions).
        count["step"] += 1
        tiered_ext.gpu_adam_step(master_data, g16, ms, vs, step=count["step"], lr=HYPER["lr"], beta1=b1,
                                 beta2=b2, eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                                 out_lowp=out16)  # fmt: skip

    out[OFFLOAD_OURS] = fused_step
    src = torch.randn(256 * M)  # 1 GiB fp32
    dst = torch.empty_like(src)
    out[COPY] = lambda: dst.copy_(src)
    return out


TORCH_FUSED = "torch AdamW fused=True fp32"
TORCH_FOREACH = "torch AdamW foreach=True fp32"
DEEPSPEED = "DeepSpeedCPUAdam fp32"
OURS = "tiered CPUAdam fp32 (ours)"
OFFLOAD_USER = "offload step, user-written: bf16 grad upcast + fused AdamW + bf16 copy-out"
OFFLOAD_OURS = "offload step, tiered fused: bf16 grad in, bf16 param out (ours)"
COPY = "memory copy_ 1 GiB fp32 (read+write counted)"
BYTES_PER_PARAM = {
    TORCH_FUSED: 28,
    TORCH_FOREACH: 28,
    DEEPSPEED: 28,
    OURS: 28,
    OFFLOAD_USER: 40,
    OFFLOAD_OURS: 28,
}


def run(threads: int, shapes: list[int], warmup: int, repeats: int, deepspeed: tuple) -> list[dict]:
    """Round-robin: every repeat runs each method once, so a burst of load on a shared machine
    hits all methods alike instead of whichever ran during it. The order rotates by one method per
    repeat, so no method always runs right after the same neighbour (whose OpenMP threads may still
    spin, or whose writes may still sit in the caches)."""
    torch.set_num_threads(threads)
    n = sum(shapes)
    methods = _methods(shapes, deepspeed[0])
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(warmup + repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = methods[name]
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(dt)
    rows = []
    for name in (COPY, TORCH_FUSED, TORCH_FOREACH, DEEPSPEED, OURS, OFFLOAD_USER, OFFLOAD_OURS):
        if name not in times:
            rows.append({"method": name, "threads": threads, "bytes_per_param": 28, "note": deepspeed[1]})
            continue
        s = statistics.median(times[name])
        if name == COPY:
            rows.append({"method": name, "threads": threads, "bytes_per_param": 8, "s_per_step": s,
                         "gb_per_s": 2 * 256 * M * 4 / s / 1e9, "note": "yardstick"})  # fmt: skip
            continue
        bpp = BYTES_PER_PARAM[name]
        rows.append({"method": name, "threads": threads, "bytes_per_param": bpp, "s_per_step": s,
                     "mparams_per_s": n / s / 1e6, "gb_per_s": n * bpp / s / 1e9, "note": "",
                     "all_s": [round(t, 5) for t in times[name]]})  # fmt: skip
    del methods
    gc.collect()
    return rows


def _ratio(rows: list[dict], a: str, b: str) -> float | None:
    ta = next((x.get("s_per_step") for x in rows if x["method"].startswith(a)), None)
    tb = next((x.get("s_per_step") for x in rows if x["method"].startswith(b)), None)
    return tb / ta if ta and tb else None


def markdown(all_rows: dict[int, list[dict]], meta: dict) -> str:
    lines = [
        f"Run {meta['date']} on {meta['machine']}; torch {meta['torch']}; kernel path {meta['cpu_adam']}; "
        f"{meta['params'] / 1e6:.1f}M params in {meta['tensors']} tensors; median of {meta['repeats']} after "
        f"{meta['warmup']} warm-ups, methods interleaved round-robin.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| method | threads | s/step | M params/s | B/param | effective GB/s | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for threads, rows in all_rows.items():
        for x in rows:
            if "s_per_step" in x:
                mp = f"{x['mparams_per_s']:.0f}" if "mparams_per_s" in x else "-"
                lines.append(f"| {x['method']} | {threads} | {x['s_per_step']:.4f} | {mp} | {x['bytes_per_param']:g} | "
                             f"{x['gb_per_s']:.1f} | {x['note']} |")  # fmt: skip
            else:
                lines.append(
                    f"| {x['method']} | {threads} | - | - | {x['bytes_per_param']:g} | - | {x['note']} |"
                )
    lines += ["", "| ratio (higher is better for ours) | threads | value | target |", "|---|---|---|---|"]
    for threads, rows in all_rows.items():
        for label, a, b, target in (
            ("ours fp32 vs torch AdamW fused", "tiered CPUAdam", "torch AdamW fused", ">= 1.0"),
            ("ours fp32 vs DeepSpeedCPUAdam", "tiered CPUAdam", "DeepSpeedCPUAdam", ">= 1.0"),
            ("offload fused vs user-written", "offload step, tiered", "offload step, user", ">= 1.4"),
        ):
            r = _ratio(rows, a, b)
            lines.append(f"| {label} | {threads} | {f'{r:.2f}x' if r else 'n/a (absent)'} | {target} |")
    return "\n".join(lines) + "\n"


def _machine() -> str:
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} vCPU {model}, {platform.system()} {platform.release()}"


def write_results(text: str, path: Path) -> None:
    """Replaces the '## CPU Adam' section of RESULTS.md (other sections belong to other benchmarks)."""
    section = "## CPU Adam\n\nWritten by `benchmarks/adam.py --write-results`.\n\n" + text + "\n"
    old = path.read_text() if path.exists() else "# Benchmark results\n\n"
    if "## CPU Adam" in old:
        head, rest = old.split("## CPU Adam", 1)
        nxt = rest.find("\n## ")
        tail = rest[nxt + 1 :] if nxt >= 0 else ""
        new = head + section + tail
    else:
        new = old.rstrip("\n") + "\n\n" + section
    path.write_text(new)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--scale", type=float, default=1.0, help="multiply every tensor size (0.01 for a smoke run)"
    )
    ap.add_argument(
        "--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam (its first build takes ~45 s)"
    )
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument(
        "--write-results", action="store_true", help="update the CPU Adam section of benchmarks/RESULTS.md"
    )
    args = ap.parse_args(argv)
    shapes = [max(1, int(n * args.scale)) for n in SHAPES]
    info = tiered_ext.kernel_info()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "torch": torch.__version__,
        "cpu_adam": info["cpu_adam"],
        "params": sum(shapes),
        "tensors": len(shapes),
        "repeats": args.repeats,
        "order": "round-robin over methods within each repeat",
        "warmup": args.warmup,
        "command": "python benchmarks/adam.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    deepspeed = _deepspeed_cls() if not args.no_deepspeed else (None, "absent (--no-deepspeed)")
    all_rows = {t: run(t, shapes, args.warmup, args.repeats, deepspeed) for t in args.threads}
    text = markdown(all_rows, meta)
    sys.stdout.write(text)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": all_rows}, indent=1))
    if args.write_results:
        write_results(text, Path(__file__).resolve().parent / "RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
