"""The plan's predicted s/step for benchmarks/step.py's tiered run, next to what step.py measured
(issue 21: within 25%?). Same model, same config (`step.ds_json`), same tokens (4 x 128), the
same time model as `tiered plan` ([Note: step time model] in tiered/planning/timing.py): the
bytes of [Note: bytes per step] over the disk bandwidth of ``tiered bench --json`` (--bandwidth)
or the defaults, the CPU Adam at its element rate, and the compute timed on the model's own
layer (`tiered plan --model`'s probe, [Note: model compute probe]; ``--compute matmul``: the
training FLOPs over a matmul probe, as before) on this machine's cores (CPU-only: the Adam shares
the cores with the compute).

    python benchmarks/step.py --steps 4 --no-deepspeed --json step.json
    python benchmarks/step_predict.py --measured step.json [--bandwidth bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from step import build_model, ds_json  # noqa: E402

from tiered.config.loader import load_config  # noqa: E402
from tiered.planning.compute_probe import probe_model_compute  # noqa: E402
from tiered.planning.needs import predict  # noqa: E402
from tiered.planning.timing import (  # noqa: E402
    DEFAULT_BANDWIDTH,
    compute_threads_beside_engine,
    config_seconds_per_step,
    probe_flops,
    read_bandwidth,
    training_flops,
)

BATCH, SEQ = 4, 128  # step.make_data
TOKENS = BATCH * SEQ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measured", help="step.py --json output to compare with")
    ap.add_argument("--bandwidth", help="tiered bench --json output (default: the plan's assumed bandwidths)")
    ap.add_argument(
        "--overlap", action="store_true", help="as step.py --overlap (compared with its overlap run)"
    )
    ap.add_argument(
        "--compute",
        choices=("model", "matmul"),
        default="model",
        help="the compute term: the model's own layer timed (default; what tiered plan --model does) or "
        "the FLOPs over a matmul probe (what tiered plan --params does)",
    )
    ap.add_argument("--probe-seconds", type=float, default=1.0, help="matmul probe length (default 1 s)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    bw = dict(DEFAULT_BANDWIDTH)
    if args.bandwidth:
        bw, _ = read_bandwidth(args.bandwidth)
    model = build_model()
    flops = training_flops(sum(p.numel() for p in model.parameters()), TOKENS)
    probe_said: dict[str, object] = {}
    if args.compute == "model":
        # as tiered plan does on a CPU-only host: [Note: compute beside the engine's threads]
        probe = probe_model_compute(
            model.config, micro_batch=BATCH, seq_len=SEQ, threads=compute_threads_beside_engine()
        )
        bw["flops"] = flops / probe.step_seconds()  # the rate that makes the term the measured seconds
        probe_said = {"probe": probe.describe(), "probe_passes": probe.passes}
    else:
        bw["flops"] = probe_flops(
            "cpu", torch.float32, seconds=args.probe_seconds, threads=compute_threads_beside_engine()
        )
    with tempfile.TemporaryDirectory() as d:
        config = ds_json(d)
        config["tiered"] = {"residency": "off"}  # step.py's like-for-like row: everything through NVMe
        if args.overlap:
            config["tiered"]["overlap_step_with_backward"] = True
        cfg = load_config(config, model=model)
        pred = predict(model, cfg, gpu_is_host=True, device_kind="cpu")
    predicted, traffic, adam, step_reads = config_seconds_per_step(
        pred, cfg, bw, compute_flops=flops, shared_cores=True
    )
    io = traffic["disk->host"] / bw["disk_read"] + traffic["host->disk"] / bw["disk_write"]
    out = {
        "predicted_s": predicted,
        "compute_s": flops / bw["flops"],
        "adam_s": adam / bw["cpu_adam"],
        "disk_s": io,
        "step_state_reads_s": step_reads / bw["disk_read"],
        "flops_per_s": bw["flops"],
        "compute_from": args.compute,
        **probe_said,
        "threads": torch.get_num_threads(),
        "probe_threads": compute_threads_beside_engine(),
        "bytes_per_step": traffic,
    }
    if args.measured:
        m = json.loads(Path(args.measured).read_text())["tiered_overlap" if args.overlap else "tiered"]
        out["measured_s"] = m["step_s"]
        out["predicted_over_measured"] = predicted / m["step_s"]
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
