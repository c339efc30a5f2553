"""issue 21: the process baseline of [Note: one memory model], measured.

Each measurement is a fresh interpreter that imports torch, transformers and tiered (the
built-in nvme backend too, as a run that offloads to NVMe opens it), builds a small Llama
skeleton on the meta device, runs one training step of a tiny real Llama (bf16 forward, backward
and AdamW: the code pages and thread pools the compute brings in, as a run's first step does;
on the device with --cuda) and reads its own VmRSS and VmHWM from /proc/self/status. The
median of --runs is printed with the spread; `tiered.planning.needs.HOST_BASELINE_BYTES` holds
that median, rounded to a MiB, per device kind ([Note: one memory model]). Run it under the venv the engine runs in, e.g.

    PYTHONPATH=$PWD:$PWD/plugins python benchmarks/host_baseline.py --runs 5

With ``--cuda`` the child also creates the CUDA context and runs one bf16 matrix product on the
device (cuBLAS loaded), which is what a CUDA run's baseline needs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = r"""
import json, sys
import torch, transformers
import tiered
import tiered_nvme.backend  # noqa: F401 - an NVMe run opens it
if CUDA:  # the context, and cuBLAS loaded by one bf16 product, as the first training step does
    a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
hf = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                              num_attention_heads=8, num_key_value_heads=8, vocab_size=4096)
with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(hf)
# one step of a tiny real model (its tensors are a few hundred KiB): what the compute itself
# loads, not what it holds ([Note: compute memory on a CPU-only machine])
tiny = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, vocab_size=256)
dev = "cuda" if CUDA else "cpu"
step_model = transformers.AutoModelForCausalLM.from_config(tiny).to(dev, torch.bfloat16)
ids = torch.randint(0, 256, (1, 64), device=dev)
step_model(input_ids=ids, labels=ids).loss.backward()
torch.optim.AdamW(step_model.parameters()).step()
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kib = lambda key: int(status[key].split()[0]) * 1024
print("RESULT " + json.dumps({"rss": kib("VmRSS"), "hwm": kib("VmHWM")}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cuda", action="store_true", help="create the CUDA context too")
    a = ap.parse_args()
    rows = []
    for _ in range(a.runs):
        p = subprocess.run(
            [sys.executable, "-c", f"CUDA = {a.cuda!r}\n" + _CHILD],
            capture_output=True,
            text=True,
            check=False,
        )
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"child failed (rc {p.returncode}): {p.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(line[7:]))
    mib = 2**20
    out = {
        "runs": a.runs,
        "cuda": a.cuda,
        "torch": __import__("torch").__version__,
        "transformers": __import__("transformers").__version__,
        "rss_mib": [round(r["rss"] / mib, 1) for r in rows],
        "hwm_mib": [round(r["hwm"] / mib, 1) for r in rows],
        "median_hwm_mib": round(statistics.median(r["hwm"] for r in rows) / mib, 1),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
