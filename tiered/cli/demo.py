"""`tiered demo`: the main job on its default. For now: plan a 40B model on one 80 GB GPU, then
measure the built-in file backends' bandwidth in a temporary directory (a quick run).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any, TextIO

DEMO_PLAN_ARGS = ["--params", "40B", "--gpu-mem", "80GB", "--cpu-mem", "512GB", "--nvme-mem", "4TB",
                  "--world-size", "1"]

DESCRIPTION = """\
A two-part tour, in under a minute on a laptop-class machine:
  1. tiered plan for fine-tuning a 40B model on one 80 GB GPU with 512 GB RAM and a 4 TB NVMe:
     which ZeRO placements fit, and the config to launch with;
  2. tiered bench --quick: write/read GB/s of the nvme, aiofiles and tensorstore backends against
     an O_DIRECT ceiling (and fio if installed), in a temporary directory.
"""

EPILOG = """\
examples:
  tiered demo                 # both parts (the bench runs in the system temp directory)
  tiered demo --dir /mnt/nvme0
  tiered demo --plan-only
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="the main job on its default: plan a 40B model, then a quick bench",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dir", default=None, help="where the quick bench writes (default: system temp dir)")
    p.add_argument("--plan-only", action="store_true", help="skip the bandwidth part")
    p.add_argument("--quick", action="store_true", help="accepted for symmetry; the demo is always quick")
    p.add_argument("--bench-size", default="64MiB", metavar="SIZE", help="bytes per transfer in part 2 (default 64MiB)")
    return p


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from tiered.cli import bench, plan

    out = out or sys.stdout
    parser = argparse.ArgumentParser(prog="tiered")
    sub = parser.add_subparsers(dest="command")
    plan.add_parser(sub)
    bench.add_parser(sub)

    out.write("== 1. tiered plan " + " ".join(DEMO_PLAN_ARGS) + "\n\n")
    plan_status = plan.run(parser.parse_args(["plan", *DEMO_PLAN_ARGS]), out)
    if args.plan_only:
        return plan_status
    with tempfile.TemporaryDirectory(prefix="tiered-demo-", dir=args.dir) as tmp:
        out.write(f"\n== 2. tiered bench --quick --dir {tmp}\n\n")
        out.flush()
        bench_status = bench.run(parser.parse_args(
            ["bench", "--quick", "--quiet", "--dir", tmp, "--size", args.bench_size]
        ), out)
    return max(plan_status, bench_status)
