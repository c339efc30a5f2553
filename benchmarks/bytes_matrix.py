"""benchmarks/step.py's tiered runner in fp32 and bf16 mixed precision, with and without gradient
accumulation, the step overlapped with backward or not: NVMe bytes per step measured by the tier
manager's link counters next to the formula of [Note: bytes per step] (the engine's
`stats()["bytes_per_step"]["formula"]`, the figure `tiered plan` prints). Issue 22 item 2 asks
them within 1.05x in each setting.

    python benchmarks/bytes_matrix.py [--steps 4] [--nvme-dir DIR] [--json out.json]

The model, data and JSON are step.py's (35.7M-parameter Llama, micro-batch 4 x 128, parameters and
AdamW state on NVMe); `--accumulation` micro-batches make one step (step() after each, as
DeepSpeed's loop calls it). read = nvme->cpu + nvme->gpu against the formula's disk->host, write =
cpu->nvme + gpu->nvme against host->disk, both the mean of the steps after --warmup; each step's
write-backs are waited for before its counters are read (without it a step's window holds the
previous step's late writes, +-8% with one measured step). Bytes only: the times of a run are
step.py's business.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from step import make_data, run_tiered  # noqa: E402


def nvme_bytes(links: dict[str, dict[str, float]]) -> tuple[float, float]:
    """(read, written) bytes of the NVMe links, whichever tier they served."""
    read = sum(v["bytes"] for k, v in links.items() if k.startswith("nvme->"))
    written = sum(v["bytes"] for k, v in links.items() if k.endswith("->nvme"))
    return read, written


def run_matrix(
    steps: int, warmup: int, base: Path, precisions: list[str], accumulations: list[int]
) -> list[dict[str, Any]]:
    rows = []
    for precision, accumulation, overlap in itertools.product(precisions, accumulations, (False, True)):
        folder = base / f"{precision}_a{accumulation}_{'overlap' if overlap else 'after'}"
        folder.mkdir(parents=True, exist_ok=True)
        try:
            r = run_tiered(
                make_data(steps * accumulation),
                warmup,
                str(folder),
                overlap=overlap,
                precision=precision,
                accumulation=accumulation,
                settle_writes=True,  # a step's write-backs in its own window
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        read, written = nvme_bytes(r["links_per_step"])
        formula = r["bytes_per_step_formula"]
        rows.append(
            {
                "precision": precision,
                "accumulation": accumulation,
                "overlap": overlap,
                "read_bytes": read,
                "write_bytes": written,
                "formula": formula,
                "read_over_formula": read / formula["disk->host"],
                "write_over_formula": written / formula["host->disk"],
                "losses": r["losses"],
                "step_s": r["step_s"],
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| precision | accumulation | step overlapped | NVMe read MB (/ formula) | NVMe write MB (/ formula) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['precision']} | {r['accumulation']} | {'yes' if r['overlap'] else 'no'} | "
            f"{r['read_bytes'] / 1e6:.1f} ({r['read_over_formula']:.3f}) | "
            f"{r['write_bytes'] / 1e6:.1f} ({r['write_over_formula']:.3f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="steps per setting (default 4)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps (the trace is recorded there)")
    ap.add_argument("--nvme-dir", default=None, help="directory for the NVMe files (default: a temp dir)")
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--accumulation", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} must exceed --warmup {args.warmup}: nothing would be measured")
    if any(a < 1 for a in args.accumulation):
        ap.error(f"--accumulation {args.accumulation}: each must be >= 1")
    base = Path(args.nvme_dir) if args.nvme_dir else Path(tempfile.gettempdir())
    if not base.is_dir():
        ap.error(f"--nvme-dir {base} is not a directory")
    work = Path(tempfile.mkdtemp(prefix="tiered_bytes_", dir=base))
    try:
        rows = run_matrix(args.steps, args.warmup, work, args.precision, args.accumulation)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    worst = max(max(r["read_over_formula"], r["write_over_formula"]) for r in rows)
    print(f"largest measured / formula: {worst:.3f} (issue 22 item 2: <= 1.05)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
