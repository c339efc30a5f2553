#!/usr/bin/env python
"""Checkpoint save and load GB/s next to a raw sequential write and read of the same bytes, in
the same run, on the same directory; and the RSS peak growth while saving.

    python benchmarks/checkpoint.py [--params 16] [--placement nvme nvme] [--dir DIR] [--json out.json]

A model of `--params` million fp32 parameters in 4M-element shard groups, one Adam step taken;
its state (parameter = master, exp_avg, exp_avg_sq: 12 B per parameter) is saved with
engine.save_checkpoint and loaded back with engine.load_checkpoint. The raw yardstick writes the
checkpoint's byte count to one file in 16 MiB chunks with fsync, then reads it back. Page cache
is dropped for the files read (posix_fadvise DONTNEED) before each read, for both. A load reads
every file twice (checksum first, then the slices) and writes every partition to its tier: on
nvme placement that is a write of the same bytes again, which the ratio includes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

import tiered

CHUNK = 16 << 20


def _drop_cache(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw(path: Path, nbytes: int) -> tuple[float, float]:
    buf = memoryview(bytearray(os.urandom(1 << 20)) * (CHUNK >> 20))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = nbytes
    while left > 0:
        left -= os.write(fd, buf[: min(left, CHUNK)])
    os.fsync(fd)
    os.close(fd)
    w = time.perf_counter() - t0
    _drop_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        rb = bytearray(CHUNK)
        while f.readinto(rb):
            pass
    r = time.perf_counter() - t0
    os.remove(path)
    return nbytes / w / 1e9, nbytes / r / 1e9


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=16, help="million parameters (default 16: 192 MB of state)")
    ap.add_argument(
        "--placement",
        nargs=2,
        default=["nvme", "nvme"],
        metavar=("PARAM", "OPT"),
        help="offload_param / offload_optimizer device: none|cpu|nvme",
    )
    ap.add_argument(
        "--dir", type=Path, default=None, help="where checkpoints and swap files go (default: a temp dir)"
    )
    ap.add_argument("--json", type=Path, help="also write the result as JSON here")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="tiered-ckpt-bench-"))
    layers = max(1, args.params // 4)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(layers)])
    zero = {"stage": 3, "sub_group_size": 4 << 20, "stage3_param_persistence_threshold": 0}
    for key, dev in (("offload_param", args.placement[0]), ("offload_optimizer", args.placement[1])):
        if dev != "none":
            zero[key] = {"device": dev, **({"nvme_path": str(root / "swap")} if dev == "nvme" else {})}
    (root / "swap").mkdir()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    with tiered.initialize(model, config) as e:
        e.backward(e(torch.randn(2, 2048)).square().mean())
        e.step()
        e.flush()
        importlib.import_module(
            "tiered.checkpoint.engine_state"
        )  # first imports (numpy, ...): ~60 MB not the save's
        Path("/proc/self/clear_refs").write_text("5")
        rss0 = _vm_kib("VmRSS")
        t0 = time.perf_counter()
        path = Path(e.save_checkpoint(root / "ckpt"))
        save_s = time.perf_counter() - t0
        rss_growth = (_vm_kib("VmHWM") - rss0) * 1024
        nbytes = sum(f.stat().st_size for f in path.iterdir())
        _drop_cache(path)
        t0 = time.perf_counter()
        e.load_checkpoint(root / "ckpt")
        load_s = time.perf_counter() - t0
    raw_w, raw_r = _raw(root / "raw.bin", nbytes)
    result = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "placement": args.placement,
        },
        "checkpoint_bytes": nbytes,
        "save_GBps": nbytes / save_s / 1e9,
        "load_GBps": nbytes / load_s / 1e9,
        "raw_write_GBps": raw_w,
        "raw_read_GBps": raw_r,
        "save_vs_raw_write": nbytes / save_s / 1e9 / raw_w,
        "load_vs_raw_read": nbytes / load_s / 1e9 / raw_r,
        "rss_growth_while_saving_bytes": rss_growth,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    import shutil

    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
