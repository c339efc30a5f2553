"""`tiered demo`: the main job on its default. Fine-tune the embedded tiny Llama with parameters
and Adam state offloaded to NVMe files (checked against plain PyTorch AdamW), then the plan for a
40B model on one 80 GB GPU; `--bench` adds a quick bandwidth run of the built-in file backends.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import TextIO

from tiered.cli.demo_finetune import PLAN_40B_ARGS

DESCRIPTION = """\
A tour in about a minute on a laptop-class machine:
  1. fine-tune the embedded tiny Llama (examples/tiny-llama) on the embedded corpus through an
     unchanged DeepSpeed config with parameters and optimizer state on NVMe files (a temporary
     directory), showing the loss fall and the same steps of plain PyTorch AdamW beside it, and
     exporting the model through `tiered finetune --out` (temporary unless --out DIR);
  2. tiered plan for fine-tuning a 40B model on one 80 GB GPU with 512 GB RAM and a 4 TB NVMe:
     which placements fit, and the fastest config that does, with its predicted s/step;
  3. with --bench: write/read GB/s of the nvme, aiofiles and tensorstore backends against an
     O_DIRECT ceiling (and fio if installed).
"""

EPILOG = """\
examples:
  tiered demo                 # fine-tune + plan (offload files in the system temp directory)
  tiered demo --quick         # fewer fine-tuning steps
  tiered demo --dir /mnt/nvme0 --bench
  tiered demo --out run       # keep the trained model in run/final
  tiered demo --plan-only
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="the main job on its default: fine-tune a tiny Llama offloaded to NVMe, plan a 40B model",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dir", default=None, help="where offload files and the bench go (default: system temp dir)"
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="the fine-tuning's run folder, kept: the trained model in DIR/final (default: temporary)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="--out holds an earlier run's checkpoints: replace them"
    )
    p.add_argument("--plan-only", action="store_true", help="only the 40B plan")
    p.add_argument("--quick", action="store_true", help="fewer fine-tuning steps")
    p.add_argument("--bench", action="store_true", help="add a quick bandwidth run of the file backends")
    p.add_argument(
        "--bench-size", default="64MiB", metavar="SIZE", help="bytes per transfer in part 2 (default 64MiB)"
    )
    return p


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from tiered.cli import bench, plan

    out = out or sys.stdout
    parser = argparse.ArgumentParser(prog="tiered")
    sub = parser.add_subparsers(dest="command")
    plan.add_parser(sub)
    bench.add_parser(sub)

    if args.plan_only:
        out.write("== tiered plan " + " ".join(PLAN_40B_ARGS) + "\n\n")
        return plan.run(parser.parse_args(["plan", *PLAN_40B_ARGS]), out)
    from tiered.cli.demo_finetune import run_demo

    # run_demo prints the 40B plan's verdict after the fine-tuning part.
    keep = (
        {"run_dir": Path(args.out), "overwrite": args.overwrite} if args.out else {}
    )  # tiered finetune --out
    demo_status = run_demo(args.quick, Path(args.dir) if args.dir else None, out, **keep)
    if not args.bench:
        return demo_status
    with tempfile.TemporaryDirectory(prefix="tiered-demo-", dir=args.dir) as tmp:
        out.write(f"\n== 3. tiered bench --quick --dir {tmp}\n\n")
        out.flush()
        bench_status = bench.run(
            parser.parse_args(["bench", "--quick", "--quiet", "--dir", tmp, "--size", args.bench_size]), out
        )
    return max(demo_status, bench_status)
