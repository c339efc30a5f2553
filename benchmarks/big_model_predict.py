"""`tiered plan`'s memory and time model on the 2B replica's own config (benchmarks/big_model.py),
without running it: the bytes per link and the s/step it predicts, to set beside the replica's
measured ones (issue 21: s/step within 25 %; issue 41: the same at two cpu budgets). Takes
big_model.py's own options and defaults (2.07B Llama, hidden 2560, 25 layers, vocab 16384, 1 x
128 tokens, fp32; parameters, gradients and Adam state homed on NVMe, the step overlapped with
backward, the gpu and cpu tiers' budgets from --gpu-frac / --cpu-frac), builds the model on the
meta device and the replica's exact JSON (`big_model_engine.engine_config`, budgets included), and
predicts it as `tiered plan` weighs a config: `tiered.planning.needs.predict` (what the tiers keep
within those budgets, [Note: residency]) and `config_seconds_per_step` ([Note: step time model])
with the compute timed on the model's own layer here ([Note: model compute probe]) and the links
and host rates of --bandwidth (`tiered bench --json`). (Through `tiered plan` itself the numbers
would be of the search's own budgets: on a host without a GPU it counts the "gpu" tier in the
host memory given, so its cpu budget is not the replica's.)

    python benchmarks/big_model_predict.py [big_model.py options] [--bandwidth bench.json] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import big_model  # noqa: E402
import big_model_engine as eng  # noqa: E402


def predict_replica(spec: dict[str, Any], bandwidth: str | None) -> dict[str, Any]:
    """The replica's config predicted ([Note: step time model]): s/step, bytes per link, kept state."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tiered.config.loader import load_config
    from tiered.planning.compute_probe import probe_model_compute
    from tiered.planning.needs import predict
    from tiered.planning.timing import (
        DEFAULT_BANDWIDTH,
        compute_threads_beside_engine,
        config_seconds_per_step,
        read_bandwidth,
    )

    hf = LlamaConfig.from_dict(spec["hf_config"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    cfg = load_config(eng.engine_config(spec), model=model)
    bw, said = read_bandwidth(bandwidth) if bandwidth else (dict(DEFAULT_BANDWIDTH), ["bandwidths assumed"])
    micro = int(spec.get("accumulation", 1))
    probe = probe_model_compute(
        hf, micro_batch=spec["batch"], seq_len=spec["seq"], threads=compute_threads_beside_engine()
    )
    flops = 6 * spec["params"] * spec["batch"] * spec["seq"] * micro
    bw["flops"] = flops / probe.step_seconds(micro)
    pred = predict(model, cfg, gpu_is_host=True, device_kind="cpu")
    step = config_seconds_per_step(pred, cfg, bw, compute_flops=flops, shared_cores=True)
    return {
        "seconds_per_step": step.seconds,
        "bytes_per_step": step.traffic,
        "kept_state_bytes": pred.residency.bytes_in("cpu", "state"),
        "compute_probe": probe.describe(),
        "rates": said,
        "cpu_budget": spec["cpu_budget"],
        "gpu_budget": spec["gpu_budget"],
    }


def main(argv: list[str] | None = None) -> int:
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument(
        "--bandwidth", help="tiered bench --json output (default: the plan's assumed bandwidths)"
    )
    ours.add_argument("--json", action="store_true", help="print the prediction as JSON")
    mine, rest = ours.parse_known_args(argv)
    args = big_model.argument_parser().parse_args(rest)
    with tempfile.TemporaryDirectory(prefix="big-model-predict-") as d:
        spec = big_model.make_spec(args, Path(d))
        out = predict_replica(spec, mine.bandwidth)
    if mine.json:
        print(json.dumps(out, indent=1))
        return 0
    t = out["bytes_per_step"]
    print(
        f"predicted {out['seconds_per_step']:.2f} s/step; NVMe read {t['disk->host'] / 1e9:.2f} GB, "
        f"write {t['host->disk'] / 1e9:.2f} GB per step; state kept in the cpu tier "
        f"{out['kept_state_bytes'] / 2**30:.2f} GiB (cpu budget {out['cpu_budget'] / 2**30:.2f} GiB)"
    )
    print("  compute: " + out["compute_probe"])
    for line in out["rates"]:
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
