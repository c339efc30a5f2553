#!/usr/bin/env python
"""Checkpoint save and load GB/s next to a raw sequential write and read of the same bytes, in
the same run, on the same directory; and the RSS peak growth while saving and while loading.

    python benchmarks/checkpoint.py [--params 48] [--group 48] [--placement nvme nvme]
                                    [--rounds 3] [--dir DIR] [--json out.json]

A model of `--params` million fp32 parameters in layers of `--group` million (4096 inputs), each
its own shard group (4096 -> w -> 4096 ...; one partition per kind and group: 4 B x group), one Adam step taken; its state (parameter =
master, exp_avg, exp_avg_sq: 12 B per parameter) is saved with engine.save_checkpoint and loaded
back with engine.load_checkpoint. The raw yardstick writes the checkpoint's byte count to one
file in 16 MiB chunks with fsync, then reads it back. Each round runs raw, save, load in that
order; medians over rounds. Page cache is dropped (posix_fadvise DONTNEED) for the files read
before each read, and for the swap files before each save. A save reads every swap file once
and writes the checkpoint (fsync); a load reads every checkpoint file twice (checksum first,
then the pieces) and writes every partition to its tier: on nvme placement that is a write of
the same bytes again, which the ratio includes. Before each save and load the host tiers'
cached buffers are dropped ([Note: size-class buffer pool]): training leaves partition-sized
buffers there that would hide what a save or load allocates itself.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
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


def _drop_cached_buffers(e: tiered.Engine) -> None:
    for name in e.tm.tier_names:
        pool = getattr(e.tm.tier(name).backend, "pool", None)
        if pool is not None:
            pool.clear()


def _peak_growth(fn: Callable[[], object]) -> tuple[float, int]:
    """(seconds, peak RSS growth in bytes) of fn()."""
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    rss0 = _vm_kib("VmRSS")
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, (_vm_kib("VmHWM") - rss0) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=48, help="million parameters (default 48: 576 MB of state)")
    ap.add_argument(
        "--group",
        type=int,
        default=48,
        help="million elements per shard group (default 48: 192 MiB partitions)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="round-robin rounds of raw, save, load (median)")
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
    layers = max(1, args.params // args.group)
    torch.manual_seed(0)
    width = (args.group << 20) // 4096
    shapes = [(4096, width) if i % 2 == 0 else (width, 4096) for i in range(layers)]  # chained
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b, bias=False) for a, b in shapes])
    zero = {"stage": 3, "sub_group_size": args.group << 20, "stage3_param_persistence_threshold": 0}
    for key, dev in (("offload_param", args.placement[0]), ("offload_optimizer", args.placement[1])):
        if dev != "none":
            zero[key] = {"device": dev, **({"nvme_path": str(root / "swap")} if dev == "nvme" else {})}
    (root / "swap").mkdir()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    rounds: list[dict[str, float]] = []
    try:
        with tiered.initialize(model, config) as e:
            e.backward(e(torch.randn(2, 4096)).sum(-1).square().mean())
            e.step()
            e.flush()
            largest = max(p.nbytes for p in e.tm.partitions())
            for tag in ("safetensors", "tiered.checkpoint.engine_state"):
                importlib.import_module(tag)  # first imports (numpy, ...): ~60 MB not the save's
            ck = root / "ckpt"
            for _ in range(args.rounds):
                nbytes = _checkpoint_bytes(e, root) if not rounds else int(rounds[0]["bytes"])
                raw_w, raw_r = _raw(root / "raw.bin", nbytes)
                _drop_cache(root / "swap")
                _drop_cached_buffers(e)
                save_s, save_rss = _peak_growth(lambda: e.save_checkpoint(ck, tag="bench"))
                path = ck / "bench"
                nbytes = sum(f.stat().st_size for f in path.iterdir())
                _drop_cache(path)
                _drop_cached_buffers(e)
                load_s, load_rss = _peak_growth(lambda: e.load_checkpoint(ck, tag="bench"))
                shutil.rmtree(ck)
                rounds.append(
                    {
                        "bytes": nbytes,
                        "save_GBps": nbytes / save_s / 1e9,
                        "load_GBps": nbytes / load_s / 1e9,
                        "raw_write_GBps": raw_w,
                        "raw_read_GBps": raw_r,
                        "save_rss": save_rss,
                        "load_rss": load_rss,
                    }
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(k: str) -> float:
        return statistics.median(r[k] for r in rounds)

    result = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0],
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "placement": args.placement,
            "rounds": args.rounds,
        },
        "checkpoint_bytes": int(rounds[0]["bytes"]),
        "largest_partition_bytes": largest,
        "save_GBps": med("save_GBps"),
        "load_GBps": med("load_GBps"),
        "raw_write_GBps": med("raw_write_GBps"),
        "raw_read_GBps": med("raw_read_GBps"),
        "save_vs_raw_write": statistics.median(r["save_GBps"] / r["raw_write_GBps"] for r in rounds),
        "load_vs_raw_read": statistics.median(r["load_GBps"] / r["raw_read_GBps"] for r in rounds),
        "rss_growth_while_saving_bytes": int(max(r["save_rss"] for r in rounds)),
        "rss_growth_while_loading_bytes": int(max(r["load_rss"] for r in rounds)),
        "per_round": rounds,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def _checkpoint_bytes(e: tiered.Engine, root: Path) -> int:
    """The checkpoint's size, known only after one save: a first save, removed again."""
    path = Path(e.save_checkpoint(root / "size-probe", tag="probe"))
    n = sum(f.stat().st_size for f in path.iterdir())
    shutil.rmtree(root / "size-probe")
    return n


if __name__ == "__main__":
    main()
