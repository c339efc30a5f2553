"""What memory buys, as `tiered plan` sees it: the 40B headline planned at several host and GPU
memories (issue 41), one row each: the predicted s/step, the NVMe bytes per step, the GPU and host
peaks of the config the search chooses.

It runs ``tiered plan --json`` of the checkout it is given (``--tree``, default this one), so the
same script tabulates an older tree for a before/after table:

    python benchmarks/plan_memory_table.py [--params 40B] [--gpu 24GB 80GB]
        [--cpu 64GB 128GB 256GB 512GB 768GB] [--tree DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def plan(tree: Path, params: str, gpu: str, cpu: str, nvme: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'plugins'}"}
    argv = [sys.executable, "-m", "tiered.cli.main", "plan", "--params", params, "--gpu-mem", gpu]
    argv += ["--cpu-mem", cpu, "--nvme-mem", nvme, "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tree, check=False)
    if not out.stdout.strip():
        raise RuntimeError(f"tiered plan failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def row(doc: dict[str, Any]) -> dict[str, Any]:
    best = (doc.get("search") or {}).get("best")
    if best is None:
        return {"fits": False}
    traffic = best.get("bytes_per_step", {})
    peaks = best.get("peaks_bytes") or best.get("peaks") or {}
    return {
        "fits": True,
        "seconds_per_step": best["seconds_per_step"],
        "nvme_bytes_per_step": traffic.get("disk->host", 0) + traffic.get("host->disk", 0),
        "gpu_peak_bytes": peaks.get("device", 0),
        "host_peak_bytes": peaks.get("host", 0),
        "knobs": best.get("knobs", {}),
        "what_more_buys": best.get("what_more_buys"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="40B")
    ap.add_argument("--gpu", nargs="+", default=["24GB", "80GB"])
    ap.add_argument("--cpu", nargs="+", default=["64GB", "128GB", "256GB", "512GB", "768GB"])
    ap.add_argument("--nvme", default="8TB")
    ap.add_argument("--tree", default=str(HERE.parent), help="the checkout whose tiered plan runs")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    tree = Path(args.tree).resolve()
    rows = []
    print(
        f"{'GPU':>6} {'host':>7} {'s/step':>8} {'NVMe GB/step':>13} {'GPU peak GB':>12} {'host peak GB':>13}"
    )
    for gpu in args.gpu:
        for cpu in args.cpu:
            r = {"gpu": gpu, "cpu": cpu, **row(plan(tree, args.params, gpu, cpu, args.nvme))}
            rows.append(r)
            if not r["fits"]:
                print(f"{gpu:>6} {cpu:>7} {'nothing fits':>8}")
                continue
            print(
                f"{gpu:>6} {cpu:>7} {r['seconds_per_step']:8.1f} {r['nvme_bytes_per_step'] / 1e9:13.1f} "
                f"{r['gpu_peak_bytes'] / 1e9:12.1f} {r['host_peak_bytes'] / 1e9:13.1f}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"params": args.params, "tree": str(tree), "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
