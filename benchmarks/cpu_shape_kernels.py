"""issue 21: the host memory a new matrix shape costs where the compute runs on the CPU, measured
for [Note: per-shape kernels of a CPU MoE] (tiered/finetune/activations.py).

Each measurement is a fresh interpreter holding one expert MLP (``hidden x intermediate``, the two
weight shapes of a routed expert: up and down) in --dtype. It runs forward and backward once for
each of --counts token counts in turn (a new shape each, as an MoE's expert meets a new number of
tokens) and reads its VmRSS after every --every counts. Printed: MiB per new count over the first
--first counts (held by oneDNN's primitive cache: 1024 products, ~170 counts), and from count
--beyond on (past the cache's capacity). Run it under the venv
the engine runs in, e.g.

    python benchmarks/cpu_shape_kernels.py --shapes 64x224 256x1024 512x1024 --counts 400
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 python benchmarks/cpu_shape_kernels.py --counts 200
    python benchmarks/cpu_shape_kernels.py --dtype fp32 --counts 100
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import json, sys
import torch
hidden, inter, counts, every, dtype = json.loads(sys.argv[1])
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
F = torch.nn.functional

def rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

torch.manual_seed(0)
up = torch.randn(inter, hidden, dtype=dtype, requires_grad=True)
down = torch.randn(hidden, inter, dtype=dtype, requires_grad=True)

def step(m):
    x = torch.randn(m, hidden, dtype=dtype, requires_grad=True)
    F.linear(F.silu(F.linear(x, up)), down).sum().backward()

for m in (1, 2):  # the first products' one-off costs (thread pools, code pages) out of the count
    step(m)
start = rss_mib()
points = []
for k in range(1, counts + 1):
    step(2 + k)
    if k % every == 0:
        points.append([k, rss_mib() - start])
print("RESULT " + json.dumps(points))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes", nargs="+", default=["64x224", "256x1024", "512x1024"], help="HIDDENxINTERMEDIATE"
    )
    ap.add_argument("--counts", type=int, default=400, help="new token counts to run, one after another")
    ap.add_argument("--first", type=int, default=100, help="counts in the first slope")
    ap.add_argument("--beyond", type=int, default=200, help="counts from which the second slope is taken")
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    print(
        "| expert MLP | dtype | MiB per new count, first | MiB per new count, beyond | RSS growth MiB by count |"
    )
    print("|---|---|---|---|---|")
    for shape in a.shapes:
        hidden, inter = (int(v) for v in shape.split("x"))
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps([hidden, inter, a.counts, a.every, a.dtype])],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        points = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        grown = dict((k, v) for k, v in points)
        first = max(k for k in grown if k <= a.first)
        slope_first = grown[first] / first
        last = max(grown)
        beyond = min((k for k in grown if k >= a.beyond), default=last)
        slope_rest = (grown[last] - grown[beyond]) / (last - beyond) if last > beyond else float("nan")
        rows.append(
            {"shape": shape, "dtype": a.dtype, "first": slope_first, "rest": slope_rest, "points": points}
        )
        trail = ", ".join(f"{k}: {v:.0f}" for k, v in points)
        print(f"| {shape} | {a.dtype} | {slope_first:.2f} | {slope_rest:.2f} | {trail} |", flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
